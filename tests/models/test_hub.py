"""Hugging Face Hub names: ``hf:ORG/NAME[@REVISION][/PATH]`` for models, tokenizers and checkpoints, and
``hf://datasets/ORG/NAME[@REVISION][/PATH]`` for data, read from a Hugging Face cache laid out in ``tmp_path``
the way huggingface_hub lays out its downloads. Nothing here reaches the network: the cache is read with
``HF_HUB_OFFLINE=1``, and the online path runs against a stand-in for the Hub's file listing and download.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import huggingface_hub  # noqa: E402
import zarr  # noqa: E402

from trakcli.config.schema import DatasetConfig  # noqa: E402
from trakcli.data.load import load_dataset  # noqa: E402
from trakcli.data.text import TextDataset, load_tokenizer  # noqa: E402
from trakcli.errors import DataError, ModelError  # noqa: E402
from trakcli.models.hf import resolve_hf_path  # noqa: E402
from trakcli.models.hub import HubName, dataset_files, model_files, parse_model_name  # noqa: E402

from projects import arrays, invoke, msg, tiny_llama, word_tokenizer, write_config, write_jsonl  # noqa: E402

WORDS = ["the", "capital", "of", "is", "far", "north", "norland", "sudia", "osterby", "nivport"]
MODEL = "tiny-org/tiny-llama"


def cache_repo(cache: Path, repo_id: str, files: Path | dict[str, bytes], *, repo_type: str = "model",
               revision: str = "main") -> str:
    """Put ``files`` (a folder, or repository paths -> bytes) into the Hugging Face cache ``cache`` as
    huggingface_hub lays out a download: ``blobs/`` by content, ``snapshots/<commit>/`` links to them,
    ``refs/<revision>`` holding the commit. Returns the commit."""
    if isinstance(files, Path):
        files = {p.relative_to(files).as_posix(): p.read_bytes() for p in files.rglob("*") if p.is_file()}
    root = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(json.dumps(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in files.items()))
                          .encode()).hexdigest()
    for rel, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / revision).write_text(commit)
    return commit


def parquet(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def fact_rows(n: int, seed: int) -> list[dict]:
    g = np.random.default_rng(seed)
    countries, cities = ["norland", "sudia"], ["osterby", "nivport"]
    return [{"prompt": f"the capital of {countries[i]} is", "completion": cities[i]}
            for i in g.integers(0, 2, n).tolist()]


@pytest.fixture(scope="module")
def tiny_repos(tmp_path_factory) -> dict[str, Path]:
    """Folders of the tiny Llama with a word tokenizer: ``main``, and ``v2`` with other weights."""
    root = tmp_path_factory.mktemp("repos")
    out = {}
    for rev, shift in (("main", 0.0), ("v2", 0.05)):
        model = tiny_llama()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(shift)
        model.save_pretrained(root / rev)
        word_tokenizer(root / rev, WORDS)
        out[rev] = root / rev
    return out


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache ``$HF_HOME/hub`` read offline; the cwd a fresh ``work`` folder."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path / "hf" / "hub"


def test_featurize_a_hub_model_with_its_tokenizer_checkpoints_and_dataset(hub, tiny_repos, tmp_path, monkeypatch):
    """`trak featurize` and `trak score` with every name a Hub name; moving the cache keeps the store's identity."""
    cache_repo(hub, MODEL, tiny_repos["main"])
    cache_repo(hub, MODEL, tiny_repos["v2"], revision="v2")
    train = fact_rows(10, 0)
    cache_repo(hub, "tiny-org/facts", {
        "README.md": b"# facts\n",
        "data/train-00000-of-00002.parquet": parquet(train[:6]),
        "data/train-00001-of-00002.parquet": parquet(train[6:]),
        "data/test-00000-of-00001.parquet": parquet(fact_rows(3, 1)),
    }, repo_type="dataset")
    lm = {"prompt": "prompt", "completion": "completion", "max_length": 12}
    write_config(Path("run.yaml"), {
        "model": {"entrypoint": f"hf:{MODEL}"},  # its tokenizer is the data's
        "task": "language_modeling",
        "checkpoints": [f"hf:{MODEL}", f"hf:{MODEL}@v2"],
        "data": {"train": {"path": "hf://datasets/tiny-org/facts", **lm},  # the train split's two shards
                 "target": {"path": "hf://datasets/tiny-org/facts/data/test-*.parquet", **lm}, "batch_size": 8},
        "projector": {"kind": "rademacher", "proj_dim": 16},
        "store": {"path": "s.zarr", "chunk_rows": 8},
        "num_threads": 1,
    })
    for cmd in ("featurize", "score"):
        res = invoke(cmd, "run.yaml", "-q")
        assert res.exit_code == 0, msg(res)
    first = arrays(Path("s.zarr"))
    assert first["train/0/features"].shape == (10, 16) and np.isfinite(first["train/0/features"]).all()
    assert not np.allclose(first["train/0/features"], first["train/1/features"])  # main and v2 differ
    assert first["targets/default/0/features"].shape == (3, 16)  # the test split's shard, by its glob
    attrs = zarr.open_group("s.zarr", mode="r").attrs.asdict()
    assert attrs["identity"]["model"]["entrypoint"] == f"hf:{MODEL}"
    assert str(hub) not in json.dumps(attrs["identity"])  # what is compared names no cache folder

    moved = tmp_path / "elsewhere"
    shutil.move(str(hub.parent), str(moved))
    monkeypatch.setenv("HF_HOME", str(moved))
    res = invoke("featurize", "run.yaml", "-q")  # the same data, tokenizer and weights: nothing to redo or refuse
    assert res.exit_code == 0, msg(res)
    again = arrays(Path("s.zarr"))
    for key in ("train/0/features", "train/1/features"):
        np.testing.assert_array_equal(again[key], first[key])


def test_revisions_folders_and_files_in_a_repo_and_a_local_directory_first(hub, tiny_repos, monkeypatch):
    main = cache_repo(hub, MODEL, tiny_repos["main"])
    v2 = cache_repo(hub, MODEL, tiny_repos["v2"], revision="v2")
    snaps = hub / f"models--{MODEL.replace('/', '--')}" / "snapshots"
    assert resolve_hf_path(f"hf:{MODEL}") == snaps / main
    assert resolve_hf_path(f"hf:{MODEL}@v2") == snaps / v2
    assert resolve_hf_path(f"hf:{MODEL}@{main}") == snaps / main  # a commit
    cache_repo(hub, "tiny-org/run", {f"checkpoint-{k}/{p.name}": p.read_bytes()
                                     for k in (1, 2) for p in tiny_repos["main"].iterdir()})
    assert resolve_hf_path("hf:tiny-org/run/checkpoint-2", need="checkpoint").name == "checkpoint-2"
    with pytest.raises(ModelError, match="has no file or folder 'checkpoint-3'.*checkpoint-1, checkpoint-2"):
        resolve_hf_path("hf:tiny-org/run/checkpoint-3")
    # the tokenizer by name, with hf: or without; a local directory of the same name wins
    for spec in (MODEL, f"hf:{MODEL}"):
        tok = load_tokenizer(spec)
        assert Path(tok.name_or_path) == snaps / main and "capital" in tok.get_vocab()
    word_tokenizer(Path(MODEL), ["only", "local", "words"])
    local = load_tokenizer(MODEL)
    assert Path(local.name_or_path) == Path(MODEL) and "capital" not in local.get_vocab()
    assert resolve_hf_path(MODEL, need="tokenizer") == Path(MODEL)


def test_not_in_the_cache_is_one_error_naming_the_repo_the_cache_and_the_fixes(hub, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    with pytest.raises(ModelError) as e:
        resolve_hf_path("hf:nobody/nothing")
    text = str(e.value)
    for part in ("model.entrypoint 'hf:nobody/nothing'", "no directory at nobody/nothing", str(tmp_path / "hubcache"),
                 "HF_HUB_OFFLINE is set", "`hf download nobody/nothing`", "unset HF_HUB_OFFLINE", "local directory"):
        assert part in text, (part, text)
    # through the CLI: one red line per problem, the data URL echoed as written
    write_jsonl(Path("t.jsonl"), [{"text": "the capital"}])
    write_config(Path("run.yaml"), {
        "model": {"entrypoint": "hf:nobody/nothing@v1"},
        "task": "language_modeling",
        "checkpoints": ["hf:nobody/nothing@v1"],
        "data": {"train": {"path": "hf://datasets/nobody/nada", "text": "text"},
                 "target": {"path": "t.jsonl", "text": "text"}},
        "store": {"path": "s.zarr"},
    })
    res = invoke("featurize", "run.yaml")
    assert res.exit_code == 1
    out = msg(res)
    for part in ("hf:nobody/nothing@v1", "(revision v1)", "hf download nobody/nothing --revision v1",
                 "data.train.path 'hf://datasets/nobody/nada'", "hf download nobody/nada --repo-type dataset",
                 str(tmp_path / "hubcache")):
        assert part in out, (part, out)
    assert "hf:/datasets" not in out and "Traceback" not in out


def test_an_unreachable_hub_falls_back_to_the_cache(hub, tiny_repos, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")

    asked = []

    def no_network(self, repo_id, **kwargs):
        asked.append(repo_id)
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", no_network)
    main = cache_repo(hub, MODEL, tiny_repos["main"])
    assert resolve_hf_path(f"hf:{MODEL}").name == main
    with pytest.raises(ModelError, match=r"not in the Hugging Face cache .*the Hub cannot be reached: ConnectionError: "
                                         r"Name or service not known.*hf download other/model"):
        resolve_hf_path("hf:other/model")
    assert resolve_hf_path(MODEL, need="tokenizer").name == main
    assert asked == [MODEL, "other/model"]  # the Hub is asked once per repository


def test_online_only_the_needed_files_are_downloaded(hub, tiny_repos, monkeypatch):
    """A stand-in Hub: its file listing, and a download that records what was asked for."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    listing = ["config.json", "generation_config.json", "model.safetensors", "pytorch_model.bin", "tf_model.h5",
               "onnx/model.onnx", "onnx/config.json", "tokenizer.json", "tokenizer_config.json", "README.md"]
    asked = []
    real_info, real_download = huggingface_hub.HfApi.repo_info, huggingface_hub.snapshot_download

    def repo_info(self, *args, **kwargs):
        inspect.signature(real_info).bind(self, *args, **kwargs)  # called as the real one takes it
        return SimpleNamespace(sha=main, siblings=[SimpleNamespace(rfilename=f) for f in listing])

    def download(*args, **kwargs):
        bound = inspect.signature(real_download).bind(*args, **kwargs).arguments
        asked.append(sorted(bound["allow_patterns"]))
        return str(Path(bound["cache_dir"]) / "models--tiny-org--tiny-llama" / "snapshots" / main)

    main = cache_repo(hub, MODEL, tiny_repos["main"])
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", repo_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    assert resolve_hf_path(f"hf:{MODEL}").name == main
    assert resolve_hf_path(MODEL, need="tokenizer").name == main
    assert asked == [["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                      "tokenizer_config.json"],
                     ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]]


def _name(path: str = "", kind: str = "model") -> HubName:
    return HubName(kind, "o/n", None, path)


def test_which_files_of_a_model_repo_are_taken():
    assert model_files(["config.json", "pytorch_model.bin", "training_args.bin", "vocab.txt"], _name(), "model") == [
        "config.json", "pytorch_model.bin", "vocab.txt"]
    shards = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
              "model.safetensors.index.json", "chat_template.jinja", "additional_chat_templates/tool.jinja"]
    assert model_files(shards + ["flax_model.msgpack"], _name(), "model") == sorted(shards)
    assert model_files(["a-Q4.gguf", "README.md"], _name(), "model") == ["a-Q4.gguf"]  # no config: its one .gguf
    with pytest.raises(ModelError, match=r"2 .gguf files \(a-Q4.gguf, a-Q8.gguf\); name one, e.g. hf:o/n/a-Q4.gguf"):
        model_files(["a-Q4.gguf", "a-Q8.gguf"], _name(), "model")
    assert model_files(["a-Q4.gguf", "a-Q8.gguf"], _name("a-Q8.gguf"), "model") == ["a-Q8.gguf"]
    adapter = ["lora/adapter_config.json", "lora/adapter_model.safetensors", "lora/README.md"]
    assert model_files(adapter, _name("lora"), "checkpoint") == adapter[:2]
    with pytest.raises(ModelError, match="holds no PyTorch weights"):
        model_files(["config.json", "tf_model.h5"], _name(), "model")


def test_which_files_of_a_dataset_repo_are_taken():
    split = ["README.md", "data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
             "data/validation-00000-of-00001.parquet"]
    assert dataset_files(split, _name(kind="dataset"))[1] == split[1:3]
    assert dataset_files(split, _name("data/validation-*", "dataset"))[1] == split[3:]
    assert dataset_files(["README.md", "rows.jsonl"], _name(kind="dataset"))[1] == ["rows.jsonl"]
    saved = ["dataset_dict.json", "train/state.json", "train/data-00000-of-00001.arrow", "test/state.json",
             "test/data-00000-of-00001.arrow"]
    assert dataset_files(saved, _name(kind="dataset")) == (["train/data-00000-of-00001.arrow", "train/state.json"],
                                                           ["train"])
    with pytest.raises(DataError, match=r"2 data files and none of a train split .*name one in the URL, "
                                        r"e.g. hf://datasets/o/n/FILE"):
        dataset_files(["a.jsonl", "b.jsonl"], _name(kind="dataset"))
    with pytest.raises(DataError, match=r"read together only as .parquet or .arrow shards"):
        dataset_files(["train-1.jsonl", "train-2.jsonl"], _name(kind="dataset"))
    with pytest.raises(DataError, match="has no file or folder 'nope'"):
        dataset_files(split, _name("nope", "dataset"))


def test_hub_data_reads_like_local_data_and_its_url_is_echoed(hub, tiny_repos):
    """The fingerprint is the content's: the same rows from Hub shards and from a local file agree."""
    rows = fact_rows(7, 3)
    write_jsonl(Path("local.jsonl"), rows)
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 2, 0, 1])
    buf = io.BytesIO()
    torch.save({"x": x, "y": y}, buf)
    cache_repo(hub, "tiny-org/facts", {"train-a.parquet": parquet(rows[:4]), "train-b.parquet": parquet(rows[4:]),
                                       "tensors/data.pt": buf.getvalue()}, repo_type="dataset")
    cache_repo(hub, "tiny-org/facts", {"train.jsonl": b"".join(json.dumps(r).encode() + b"\n" for r in rows[:2])},
               repo_type="dataset", revision="v1")
    tok = str(tiny_repos["main"])
    url = "hf://datasets/tiny-org/facts"
    cfg = DatasetConfig(path=url, prompt="prompt", completion="completion", tokenizer=tok)
    assert cfg.path == url and cfg.model_dump(mode="json")["path"] == url
    hub_ds = load_dataset(cfg)
    local = TextDataset("local.jsonl", prompt="prompt", completion="completion", tokenizer=tok)
    assert len(hub_ds) == 7 and hub_ds.name.startswith(url + "[")
    assert hub_ds.fingerprint() == local.fingerprint()
    assert len(TextDataset(f"{url}@v1", prompt="prompt", completion="completion", tokenizer=tok)) == 2
    tensors = load_dataset(DatasetConfig(path=f"{url}/tensors/data.pt", inputs="x", labels="y"))
    torch.testing.assert_close(tensors.inputs, x)
    with pytest.raises(DataError, match=r"rows \[0, 1, 2, 3, 4\] of hf://datasets/tiny-org/facts have no field 'txt'"):
        TextDataset(url, text="txt", tokenizer=tok)
    with pytest.raises(DataError, match="names a model repository"):
        TextDataset("hf://tiny-org/facts", text="prompt", tokenizer=tok)


def test_what_is_a_hub_name():
    assert parse_model_name("hf:o/n@v1.0/sub/m.gguf") == HubName("model", "o/n", "v1.0", "sub/m.gguf")
    for spec in ("/abs/dir", "./o/n", "~/o/n", "single", "models/o/n", "hf://datasets/o/n", "o/n//x", "a--b/c"):
        assert parse_model_name(spec) is None, spec
