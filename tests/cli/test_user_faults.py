"""Failures a user can cause: one error line each, never a traceback.

Every test runs the CLI as a user does (``CliRunner``) on the tiny ``user_project``
and checks the exact parts of the message, the exit code, that no traceback was
printed, and that nothing already computed was lost (manifest entries, earlier
checkpoints, store arrays byte-identical).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from trakcli.errors import DataError, ProjectorError, UserCodeError, user_code
from trakcli.projectors import make_projector

from projects import arrays
from projects import invoke as trak

BAD_CODE = '''
import torch
from torch import nn


def raising_model():
    raise RuntimeError("boom")


class Raising(nn.Sequential):
    def forward(self, x):
        raise ValueError("forward boom")


def raising_forward():
    return Raising(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


class DataDependent(nn.Sequential):
    def forward(self, x):
        if x.sum() > 0:
            return super().forward(x)
        return super().forward(-x)


def data_dependent():
    return DataDependent(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def raising_train(model, inputs, labels, seed=0):
    raise KeyError("no such optimizer")


def nan_for_seed_1(model, inputs, labels, seed=0):
    if seed == 1:
        with torch.no_grad():
            model[0].weight.fill_(float("nan"))
'''


def line_of(text: str, path: str = "bad_code.py") -> int:
    """1-based line of ``text`` in ``path``."""
    return next(i for i, line in enumerate(Path(path).read_text().splitlines(), 1) if text in line)


def failed(res, code: int = 1) -> str:
    """Assert a clean failure (exit ``code``, one ``error:`` line, no traceback); return stderr."""
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output and "Traceback" not in res.stderr
    assert res.stderr.startswith("error: ") or "\nerror: " in res.stderr, res.stderr
    return res.stderr


@pytest.fixture
def project(user_project: Path) -> Path:
    (user_project / "bad_code.py").write_text(BAD_CODE)
    cfg = yaml.safe_load(Path("run.yaml").read_text())
    cfg["num_threads"] = 1
    cfg["optimize"] = {"n_models": 3, "epochs": 2, "batch_size": 8, "lr": 0.1, "seed": 5, "out_dir": "trained"}
    Path("run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return user_project




# --- data -------------------------------------------------------------------------------------------------------


def test_string_labels_in_npz(project):
    d = torch.load("ckpts/data.pt")
    np.savez("strings.npz", x=d["x_train"].numpy(), y=np.array(["cat", "dog"] * 20))
    msg = failed(trak("featurize", "run.yaml", "data.train.path=strings.npz", "data.train.inputs=x",
                      "data.train.labels=y"))
    assert "data.train: labels 'y' of strings.npz must be integer class indices, got strings (e.g. 'cat')" in msg
    assert "map each class name to an index" in msg
    assert not Path("out/attrib.zarr").exists()


def test_string_labels_in_pt(project):
    d = torch.load("ckpts/data.pt")
    torch.save({"x": d["x_train"], "y": ["cat", "dog"] * 20}, "strings.pt")
    msg = failed(trak("featurize", "run.yaml", "data.train.path=strings.pt", "data.train.inputs=x",
                      "data.train.labels=y"))
    assert "data.train: labels 'y' of strings.pt must be integer class indices, got strings (e.g. 'cat')" in msg


def test_ragged_inputs_in_pt(project):
    d = torch.load("ckpts/data.pt")
    torch.save({"x": [[1.0, 2.0], [3.0]] * 20, "y": d["y_train"]}, "ragged.pt")
    msg = failed(trak("featurize", "run.yaml", "data.train.path=ragged.pt", "data.train.inputs=x",
                      "data.train.labels=y"))
    assert "data.train: inputs 'x' of ragged.pt must be an array of numbers; it cannot be made one" in msg


def test_labels_out_of_range_in_optimize(project):
    d = torch.load("ckpts/data.pt")
    d["y_train"][5] = 7
    torch.save(d, "ckpts/data.pt")
    msg = failed(trak("optimize", "run.yaml"))
    assert "labels out of range: the model has 3 classes but examples [5] have labels [7]" in msg
    assert not Path("trained/model_000.pt").exists()


# --- user code --------------------------------------------------------------------------------------------------


def test_model_entrypoint_that_raises(project):
    msg = failed(trak("featurize", "run.yaml", "model.entrypoint=bad_code.py:raising_model"))
    line = line_of('raise RuntimeError("boom")')
    assert f"model.entrypoint bad_code.py:raising_model raised RuntimeError: boom (bad_code.py, line {line})" in msg
    assert not Path("out/attrib.zarr").exists()


def test_model_entrypoint_that_raises_shows_the_traceback_with_trak_debug(project):
    res = trak("featurize", "run.yaml", "model.entrypoint=bad_code.py:raising_model", env={"TRAK_DEBUG": "1"})
    assert res.exit_code == 1
    assert isinstance(res.exception, UserCodeError)
    assert isinstance(res.exception.__cause__, RuntimeError) and str(res.exception.__cause__) == "boom"


def test_model_file_that_fails_to_import(project):
    Path("broken.py").write_text("import torch\n\nvalue = undefined_name\n")
    msg = failed(trak("featurize", "run.yaml", "model.entrypoint=broken.py:make_model"))
    assert (
        "model.entrypoint: importing broken.py raised NameError: name 'undefined_name' is not defined "
        "(broken.py, line 3)"
    ) in msg


def test_forward_pass_that_raises(project):
    msg = failed(trak("featurize", "run.yaml", "model.entrypoint=bad_code.py:raising_forward"))
    line = line_of('raise ValueError("forward boom")')
    assert (
        "the forward pass of model.entrypoint bad_code.py:raising_forward raised ValueError: forward boom "
        f"(bad_code.py, line {line})"
    ) in msg
    assert "check data.*.inputs against model.entrypoint / model.kwargs" in msg


def test_forward_pass_that_vmap_refuses(project):
    msg = failed(trak("featurize", "run.yaml", "model.entrypoint=bad_code.py:data_dependent"))
    line = line_of("if x.sum() > 0:")
    assert (
        "per-example gradients (torch.func.vmap) of the forward pass of model.entrypoint bad_code.py:data_dependent "
        "raised RuntimeError: vmap: It looks like"
    ) in msg
    assert f"(bad_code.py, line {line}); per-example gradients run the forward pass" in msg
    assert "projector.kind kronecker" in msg


def test_training_function_that_raises(project):
    msg = failed(trak("optimize", "run.yaml", "optimize.entrypoint=bad_code.py:raising_train"))
    line = line_of('raise KeyError("no such optimizer")')
    assert (
        "optimize.entrypoint bad_code.py:raising_train raised KeyError: 'no such optimizer' "
        f"(bad_code.py, line {line})"
    ) in msg
    assert not Path("trained/model_000.pt").exists()


def test_user_code_helper_passes_trak_errors_through():
    with pytest.raises(DataError, match="^bad data$"):
        with user_code("model.entrypoint x.py:f"):
            raise DataError("bad data")


# --- projector --------------------------------------------------------------------------------------------------


def test_proj_dim_too_large_for_memory(project):
    msg = failed(trak("featurize", "run.yaml", "projector.proj_dim=100000000000"))
    assert "projector proj_dim=100000000000 needs at least " in msg
    assert "TiB of memory to project one example" in msg and "more than this machine's" in msg
    assert "use a smaller proj_dim" in msg
    assert not Path("out/attrib.zarr").exists()


def test_out_of_memory_is_one_line(project, monkeypatch):
    def run(*args, **kwargs):
        raise MemoryError("Unable to allocate 59.6 GiB for an array with shape (16, 1000000000)")

    monkeypatch.setattr(importlib.import_module("trakcli.jobs.featurize"), "featurize", run)
    msg = failed(trak("featurize", "run.yaml"))
    assert "error: out of memory: Unable to allocate 59.6 GiB" in msg
    assert "lower projector.proj_dim, data.batch_size" in msg


def test_projector_option_typo_gets_did_you_mean(project):
    msg = failed(trak("featurize", "run.yaml", "projector.proj_dims=256"))
    assert "projector.proj_dims: unknown key; did you mean projector.proj_dim?" in msg
    msg = failed(trak("featurize", "run.yaml", "projector.kind=kronecker", "projector.proj_dims=256"))
    assert "projector.proj_dims: unknown key; did you mean projector.proj_dim?" in msg
    msg = failed(trak("featurize", "run.yaml", "projector.blok_size=64"))
    assert "projector.blok_size: unknown key; did you mean projector.block_size?" in msg


def test_make_projector_kronecker_names_the_featurizer():
    with pytest.raises(ProjectorError, match="built from the model.*trakcli.gradients.KroneckerFeaturizer"):
        make_projector(kind="kronecker", grad_dim=10, proj_dim=4)
    with pytest.raises(ProjectorError, match="did you mean 'proj_dim'"):
        make_projector(grad_dim=10, proj_dim=4, proj_dims=4)


# --- config -----------------------------------------------------------------------------------------------------


def test_a_training_section_names_optimize(project):
    msg = failed(trak("optimize", "run.yaml", "training.epochs=2"))
    assert "training: is not a config section; the training recipe is the optimize: section: write training.KEY as " \
           "optimize.KEY" in msg
    assert "out_dir" not in msg


# --- trak optimize ----------------------------------------------------------------------------------------------


def test_truncated_checkpoint_is_retrained_and_its_entry_kept_until_replaced(project, monkeypatch):
    assert trak("optimize", "run.yaml").exit_code == 0
    before = json.loads(Path("trained/manifest.json").read_text())
    files = {p.name: p.read_bytes() for p in Path("trained").glob("model_*.pt")}
    Path("trained/model_001.pt").write_bytes(files["model_001.pt"][:300])

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:  # killed while retraining it: the old entry stays
        m.setattr(importlib.import_module("trakcli.jobs.optimize"), "train_one", interrupted)
        res = trak("optimize", "run.yaml")
    assert res.exit_code == 130
    assert json.loads(Path("trained/manifest.json").read_text()) == before

    res = trak("optimize", "run.yaml")
    assert res.exit_code == 0, res.output
    assert "model 1: cannot read checkpoint trained/model_001.pt" in res.stderr and "it is trained again" in res.stderr
    assert {p.name: p.read_bytes() for p in Path("trained").glob("model_*.pt")} == files  # same seed, same bytes
    after = json.loads(Path("trained/manifest.json").read_text())
    assert after["complete"] and [m["model_id"] for m in after["models"]] == [0, 1, 2]
    assert after["models"][0] == before["models"][0] and after["models"][2] == before["models"][2]
    assert after["models"][1]["sha256"] == before["models"][1]["sha256"]
    assert after["models"][1]["metrics"]["history"] == before["models"][1]["metrics"]["history"]


def test_diverging_learning_rate_stops_naming_model_and_step(project):
    msg = failed(trak("optimize", "run.yaml", "optimize.lr=1e10"))
    assert "model 0 diverged at step " in msg and "(epoch 1): the loss " in msg
    assert "the first step's" in msg and "lower the learning rate (lr 1e+10)" in msg
    assert not list(Path("trained").glob("model_*.pt")) and not Path("trained/manifest.json").exists()


def test_training_function_leaving_nan_weights_keeps_earlier_models(project):
    msg = failed(trak("optimize", "run.yaml", "optimize.entrypoint=bad_code.py:nan_for_seed_1", "optimize.seed=0"))
    assert (
        "model 1: optimize.entrypoint bad_code.py:nan_for_seed_1 left non-finite weights (0.weight (48 NaN, 0 inf))"
    ) in msg
    assert sorted(p.name for p in Path("trained").glob("model_*.pt")) == ["model_000.pt"]
    entries = json.loads(Path("trained/manifest.json").read_text())["models"]
    assert [m["model_id"] for m in entries] == [0]


def test_nan_checkpoint_weights_name_model_id_and_file(project):
    assert trak("featurize", "run.yaml").exit_code == 0
    clean = arrays("out/attrib.zarr")
    sd = torch.load("ckpts/model_1.pt")
    sd["0.weight"][2, 3] = float("nan")
    torch.save(sd, "ckpts/model_1.pt")
    msg = failed(trak("featurize", "run.yaml", "store.path=out/nan.zarr"))
    assert (
        "checkpoint ckpts/model_1.pt (model_id 1) has non-finite weights: 0.weight (1 NaN, 0 inf)" in msg
    )
    assert "retrain it (with a lower learning rate) or remove it from checkpoints" in msg
    partial = arrays("out/nan.zarr")
    for name in ("train/0/features", "train/0/out_to_loss", "train/0/done"):  # model 0 was finished before
        np.testing.assert_array_equal(partial[name], clean[name])
    assert arrays("out/attrib.zarr").keys() == clean.keys()


# --- config values and files Python alone would reject with a traceback -----------------------------------------


@pytest.mark.parametrize(
    "override, key, kind",
    [
        ("projector.proj_dim=on", "projector.proj_dim", "an integer"),
        ("data.batch_size=yes", "data.batch_size", "an integer"),
        ("store.chunk_rows=true", "store.chunk_rows", "an integer"),
        ("score.lambda_rel=on", "score.lambda_rel", "a number"),
    ],
)
def test_yaml_booleans_are_not_numbers(project, override, key, kind):
    msg = failed(trak("featurize", "run.yaml", override))
    assert f"{key}: must be {kind}, not a boolean (YAML reads on/off, yes/no and true/false as booleans)" in msg
    assert not Path("out").exists()


def test_yaml_boolean_in_the_config_file_is_refused(project):
    Path("run.yaml").write_text(Path("run.yaml").read_text().replace("proj_dim: 16", "proj_dim: on"))
    msg = failed(trak("featurize", "run.yaml"))
    assert "projector.proj_dim: must be an integer, not a boolean" in msg and "(got True)" in msg


def test_config_file_that_is_not_utf8(project):
    Path("run.yaml").write_bytes(Path("run.yaml").read_bytes().replace(b"model:", b"m\xe9del:", 1))
    msg = failed(trak("featurize", "run.yaml"))
    assert "run.yaml is not UTF-8 text: byte 0xe9 on line 1 cannot be decoded; save the config as UTF-8" in msg


@pytest.mark.parametrize("path", [".", "out/..", "/"])
def test_store_path_that_names_no_directory_of_its_own(project, path):
    msg = failed(trak("featurize", "run.yaml", f"store.path={path}"))
    assert "store.path: must name the store's own directory (its lock file goes beside it)" in msg
    assert f"(got '{path}')" in msg


@pytest.mark.parametrize("name", ["''", "../x", "a/b", "..", "__zarr"])
def test_experiment_names_that_are_not_one_store_group(project, name):
    msg = failed(trak("score", "run.yaml", f"score.experiment={name}"))
    assert "score.experiment: must name one group of the store: a non-empty name without '/'" in msg
    assert "e.g. score.experiment=test_set" in msg


def test_a_directory_where_a_file_is_expected(project):
    msg = failed(trak("featurize", "ckpts"))
    assert "config file 'ckpts' is a directory, not a file; pass the path of a YAML file" in msg
    msg = failed(trak("featurize", "run.yaml", "data.train.path=ckpts"))
    assert "data.train.path: 'ckpts' is a directory, not a file; give a .pt, .npz or text data file" in msg


def test_checkpoint_the_user_cannot_read(project, monkeypatch):
    Path("ckpts/model_1.pt").chmod(0)
    if os.geteuid() == 0:  # root reads files whatever their permissions: the open fails as it would for a user
        import builtins

        real_open = builtins.open

        def denied(file, *args, **kwargs):
            if str(file).endswith("model_1.pt"):
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", denied)
    try:
        msg = failed(trak("featurize", "run.yaml"))
    finally:
        Path("ckpts/model_1.pt").chmod(0o644)
    assert "cannot read ckpts/model_1.pt: Permission denied; make it readable by this user" in msg


def test_unreadable_checkpoint_error_is_a_checkpoint_error(tmp_path, monkeypatch):
    from trakcli.errors import CheckpointError
    from trakcli.models.checkpoints import file_sha256

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("builtins.open", denied)
    with pytest.raises(CheckpointError, match=r"cannot read .*m\.pt: Permission denied; make it readable"):
        file_sha256(tmp_path / "m.pt")


def test_optimize_onto_a_full_disk_is_one_line_and_keeps_earlier_models(project):
    import resource
    import signal
    import subprocess
    import sys

    size = len(Path("ckpts/model_0.pt").read_bytes())

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))

    res = subprocess.run(
        [sys.executable, "-m", "trakcli.cli.main", "optimize", "run.yaml", "-q"],
        capture_output=True, text=True, timeout=300, preexec_fn=limit,
    )
    text = " ".join(res.stderr.split())
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr and "unexpected pos" not in text
    assert ("error: cannot write the training state trained/.resume/model_000.pt: [Errno 27] File too large; free "
            "disk space and rerun the same command, which resumes from the last state written") in text
    assert not list(Path("trained").glob("model_*.pt")) and not list(Path("trained").rglob(".*tmp*"))
    assert trak("optimize", "run.yaml").exit_code == 0  # room again: the same command completes


def test_checkpoint_write_failure_in_torch_save_is_one_line(project, monkeypatch):
    def failing_save(obj, f, *args, **kwargs):  # torch's writer reports a failed write as a RuntimeError
        f.write(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", failing_save)
    msg = failed(trak("optimize", "run.yaml", "optimize.checkpoint_every=0"))
    assert "cannot write" in msg and "the write failed ([enforce fail at inline_container.cc:603] . unexpected pos" in msg
    assert "is the disk full?" in msg
    assert not list(Path("trained").glob("model_*.pt")) and not list(Path("trained").rglob(".*tmp*"))


def test_verify_hashes_checkpoints_again(project):
    ckpt = Path("ckpts/model_0.pt")
    old = ckpt.stat().st_mtime_ns - 3600 * 10**9
    os.utime(ckpt, ns=(old, old))  # not modified just now: its sha256 is remembered by size and mtime
    assert trak("featurize", "run.yaml").exit_code == 0
    st = ckpt.stat()
    data = bytearray(ckpt.read_bytes())
    data[-30] ^= 0xFF  # same size, other bytes, and the old mtime put back
    ckpt.write_bytes(bytes(data))
    os.utime(ckpt, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "nothing to do" in trak("featurize", "run.yaml").stderr  # the hash cache trusts size and mtime
    msg = failed(trak("featurize", "run.yaml", "--verify"))
    assert "model_id 0: the store's features come from" in msg and "this run's checkpoint" in msg


# --- the Python API's batches are checked as data files are -------------------------------------------------------


def _attributor(tmp_path):
    from trakcli import Attributor

    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model, Attributor(model, store=tmp_path / "s.zarr", projector={"kind": "rademacher", "proj_dim": 8})


@pytest.mark.parametrize(
    "batch, said",
    [
        ((torch.randn(32, 6), torch.randint(0, 3, (30,))), "batch 0 has 32 inputs but 30 labels"),
        ((torch.randn(4, 6), torch.tensor([0.5, 1.0, 0.0, 2.0])),
         "train batches: labels must be integer class indices, got non-integer floats (e.g. 0.5)"),
        ((torch.randn(4, 6), torch.tensor([0, -1, 2, 1])), "train batches: labels must be >= 0; rows [1]"),
        ((torch.randn(4, 6), torch.tensor([True, False, True, True])),
         "train batches: labels must be integer class indices, got torch.bool values"),
        ({"input_ids": torch.zeros(4, 5, dtype=torch.long), "attention_mask": torch.ones(3, 5), "labels":
          torch.zeros(4, dtype=torch.long)},
         "train batches: the inputs ['input_ids', 'attention_mask'] must have the same number of rows (> 0)"),
    ],
)
def test_api_batches_are_validated_as_the_cli_validates_data(tmp_path, batch, said):
    model, attributor = _attributor(tmp_path)
    with pytest.raises(DataError) as e:
        attributor.featurize([batch], checkpoint=model.state_dict(), model_id=0)
    assert said in str(e.value)
    assert not (tmp_path / "s.zarr").exists()


def test_api_experiment_names_are_checked_as_in_a_config(tmp_path):
    from trakcli.errors import ConfigError

    model, attributor = _attributor(tmp_path)
    batch = (torch.randn(8, 6), torch.randint(0, 3, (8,)))
    attributor.featurize([batch], checkpoint=model.state_dict(), model_id=0)
    with pytest.raises(ConfigError, match="score.experiment: must name one group of the store"):
        attributor.score([batch], checkpoints=[model.state_dict()], experiment="../x")
    assert sorted(p.name for p in (tmp_path / "s.zarr").iterdir()) == ["train", "zarr.json"]


def test_a_hub_url_given_to_targets_is_named_as_typed(user_project):
    res = trak("score", "run.yaml", "-q", "--targets", "hf://datasets/foo/bar/queries.pt")
    msg = " ".join(res.stderr.split())
    assert res.exit_code != 0 and "'hf://datasets/foo/bar/queries.pt'" in msg, msg
    assert "hf:/datasets" not in msg
    res = trak("score", "run.yaml", "-q", "--targets", "nope.pt")
    assert res.exit_code == 2 and "--targets nope.pt: no such file or directory" in res.stderr
