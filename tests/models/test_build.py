"""Models from entrypoints: the built-in MLP on the digits, a user's file or module, the errors that name the fix."""

import pytest
import torch

from trakcli.data.digits import load_digits_split
from trakcli.errors import ModelError
from trakcli.models.build import build_model

from projects import MODEL_FILE


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


