"""Tensor data files (.pt, .npz): dtypes, the errors that name the problem, and the fingerprint."""

import numpy as np
import pytest
import torch

from trakcli.config.schema import DatasetConfig
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
