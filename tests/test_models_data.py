import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from trakcli.config.schema import DatasetConfig
from trakcli.data.digits import load_digits_split
from trakcli.data.load import load_dataset
from trakcli.errors import CheckpointError, DataError, ModelError
from trakcli.models.build import build_model
from trakcli.models.checkpoints import load_checkpoint, read_state_dict

from projects import MODEL_FILE, tiny_model


def test_builtin_mlp_fits_digits():
    model = build_model("mlp")
    x_tr, y_tr, x_ta, y_ta = load_digits_split()
    assert x_tr.shape == (1437, 64) and x_ta.shape == (360, 64)
    assert x_tr.dtype == torch.float32 and y_tr.dtype == torch.int64
    assert 0 <= float(x_tr.min()) and float(x_tr.max()) <= 1
    assert model(x_tr[:3]).shape == (3, 10)
    # the split is fixed (same rows every call) and stratified: every class in both splits
    assert torch.equal(load_digits_split()[0], x_tr)
    assert set(y_tr.tolist()) == set(y_ta.tolist()) == set(range(10))


def test_entrypoints_file_and_module(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_model.py").write_text(MODEL_FILE)
    m = build_model("my_model.py:make_model", hidden=5)
    assert m[0].out_features == 5
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "nets.py").write_text(MODEL_FILE)
    assert isinstance(build_model("mypkg.nets:make_model"), torch.nn.Module)


@pytest.mark.parametrize(
    "entrypoint, kwargs, match",
    [
        ("mpl", {}, "did you mean 'mlp'"),
        ("my_model.py:make_modle", {}, "did you mean 'make_model'"),
        ("missing.py:f", {}, "does not exist"),
        ("no_such_pkg_xyz.mod:f", {}, "cannot import module"),
        ("my_model.py:make_model", {"widthh": 3}, "rejected model.kwargs"),
    ],
)
def test_entrypoint_errors(tmp_path, monkeypatch, entrypoint, kwargs, match):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_model.py").write_text(MODEL_FILE)
    with pytest.raises(ModelError, match=match):
        build_model(entrypoint, **kwargs)


def test_checkpoint_mismatch_names_keys_and_shapes(tmp_path):
    torch.save(tiny_model(hidden=9).state_dict(), tmp_path / "wide.pt")
    with pytest.raises(CheckpointError, match=r"0\.weight: checkpoint \[9, 6\] vs model \[8, 6\]"):
        load_checkpoint(tiny_model(), tmp_path / "wide.pt")
    sd = tiny_model().state_dict()
    sd["extra.weight"] = torch.zeros(1)
    del sd["2.bias"]
    torch.save(sd, tmp_path / "keys.pt")
    with pytest.raises(CheckpointError, match=r"missing keys \['2\.bias'\].*unexpected keys \['extra\.weight'\]"):
        load_checkpoint(tiny_model(), tmp_path / "keys.pt")


def test_safetensors_and_wrapped_checkpoints(tmp_path):
    src = tiny_model(seed=4)
    save_file(src.state_dict(), str(tmp_path / "m.safetensors"))
    torch.save({"state_dict": src.state_dict(), "epoch": 3}, tmp_path / "wrapped.pt")
    for name in ("m.safetensors", "wrapped.pt"):
        dst = tiny_model(seed=0)
        load_checkpoint(dst, tmp_path / name)
        assert torch.equal(dst[0].weight, src[0].weight)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        read_state_dict(tmp_path / "junk.pt")


def test_tensor_files_pt_and_npz(tmp_path):
    x, y = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float64), np.arange(10) % 2
    np.savez(tmp_path / "d.npz", x=x, y=y)
    torch.save({"x": torch.from_numpy(x), "y": torch.from_numpy(y)}, tmp_path / "d.pt")
    for name in ("d.npz", "d.pt"):
        ds = load_dataset(DatasetConfig(path=tmp_path / name, inputs="x", labels="y"))
        assert ds.inputs.dtype == torch.float32 and ds.labels.dtype == torch.int64 and len(ds) == 10
        assert ds.fingerprint()["n"] == 10


@pytest.mark.parametrize(
    "contents, match",
    [
        ({"x": np.zeros((0, 3)), "y": np.zeros(0, dtype=int)}, "is empty"),
        ({"x": np.zeros((4, 3)), "y": np.zeros(3, dtype=int)}, "4 inputs but 3 labels"),
        ({"x": np.zeros((4, 3)), "y": np.array([0.5, 1, 0, 1])}, "integer class indices"),
        ({"x": np.zeros((4, 3)), "y": np.array([0, -1, 0, 1])}, r"rows \[1\] have negative labels"),
        ({"x": np.zeros((4, 3))}, r"has no key 'y'"),
    ],
)
def test_bad_data_files(tmp_path, contents, match):
    np.savez(tmp_path / "d.npz", **contents)
    with pytest.raises(DataError, match=match):
        load_dataset(DatasetConfig(path=tmp_path / "d.npz", inputs="x", labels="y"))


def test_fingerprint_depends_on_row_order():
    x, y = torch.randn(5, 2), torch.arange(5)
    from trakcli.data.tensors import TensorDataset

    a = TensorDataset(x, y, "a").fingerprint()
    b = TensorDataset(x.flip(0), y.flip(0), "b").fingerprint()
    assert a["sha256"] != b["sha256"] and a["n"] == b["n"]
