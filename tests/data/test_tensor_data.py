"""Tensor data files (.pt, .npz): dtypes, the errors that name the problem, and the fingerprint; the bundled digits."""

import hashlib

import numpy as np
import pytest
import torch

from trakcli.config.schema import DatasetConfig
from trakcli.data.digits import load_digits_split
from trakcli.data.load import load_dataset
from trakcli.errors import DataError


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


def test_the_fingerprint_of_the_first_rows_is_that_of_those_rows_alone():
    from trakcli.data.tensors import TensorDataset
    from trakcli.errors import DataError

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(10, 3, generator=g), torch.randint(0, 3, (10,), generator=g)
    whole = TensorDataset(x, y, "d")
    assert whole.fingerprint(7) == TensorDataset(x[:7], y[:7], "d").fingerprint()
    assert whole.fingerprint(10) == whole.fingerprint()
    assert whole.fingerprint(7) != whole.fingerprint()
    ids = {"input_ids": torch.arange(40).reshape(10, 4), "attention_mask": torch.ones(10, 4, dtype=torch.long)}
    d = TensorDataset(ids, y, "t")
    assert d.fingerprint(4) == TensorDataset({k: v[:4] for k, v in ids.items()}, y[:4], "t").fingerprint()
    for bad in (0, 11, 2.5, True):
        with pytest.raises(DataError, match="cannot fingerprint the first"):
            whole.fingerprint(bad)


def test_bundled_digits_split_is_the_same_rows_every_run():
    x_tr, y_tr, x_ta, y_ta = split = load_digits_split()
    assert [list(t.shape) for t in split] == [[1437, 64], [1437], [360, 64], [360]]
    # the rows, in order, that every trakcli version gives (a store's data fingerprint depends on them)
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in split)).hexdigest()
    assert digest == "dd82963602a00ec7a5acb3d83ef540e3a20b54d2e70797c745a817e4328ba5e4"
    assert np.bincount(y_ta.numpy()).tolist() == [36, 36, 35, 37, 36, 37, 36, 36, 35, 36]  # stratified by label
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)  # together, the two splits are every row once
    rows = lambda a, b: sorted(map(tuple, np.column_stack([a, b]).tolist()))  # noqa: E731
    assert rows(torch.cat([x_tr, x_ta]).numpy() * 16, torch.cat([y_tr, y_ta]).numpy()) == rows(x, y)
