"""LoaderRows: a re-iterable of batches read as the jobs ask for rows, with the fingerprint and batches of the same
rows read into one dataset."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset as TorchRows

from trakcli.api import collect_batches
from trakcli.data.loader import LoaderRows, is_reiterable
from trakcli.data.tensors import TensorDataset
from trakcli.errors import DataError


def _pairs(n: int = 37, batch: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)  # float64: both readers make it float32
    y = torch.randint(0, 3, (n,), generator=g)
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]


def _token_dicts(n: int = 23, batch: int = 4, width: int = 9) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (n, width), generator=g)
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    am = (torch.arange(width)[None] < lengths[:, None]).long()
    labels = torch.where(am.bool(), ids, torch.full_like(ids, -100))
    return [{"input_ids": ids[i:i + batch], "attention_mask": am[i:i + batch], "labels": labels[i:i + batch]}
            for i in range(0, n, batch)]


def _same_batches(a, b) -> None:
    a, b = list(a), list(b)
    assert len(a) == len(b)
    for (lo_a, x_a, y_a), (lo_b, x_b, y_b) in zip(a, b):
        assert lo_a == lo_b
        if isinstance(x_a, dict):
            assert x_a.keys() == x_b.keys() and all(torch.equal(x_a[k], x_b[k]) for k in x_a)
        else:
            assert torch.equal(x_a, x_b) and x_a.dtype == x_b.dtype
        assert torch.equal(y_a, y_b)


@pytest.mark.parametrize("make", [_pairs, _token_dicts])
def test_streamed_rows_have_the_fingerprint_and_batches_of_the_rows_read_at_once(make):
    batches = make()
    whole, first = collect_batches(batches, "train batches")
    rows = LoaderRows(batches, "train batches")
    assert len(rows) == len(whole) and rows.first_rows == first
    assert rows.fingerprint() == whole.fingerprint()
    assert rows.fingerprint(10) == whole.fingerprint(10)
    max_tokens = 12 if isinstance(batches[0], dict) else None
    for lo, hi in [(0, 8), (8, 16), (16, len(whole)), (3, 11)]:  # in order (one pass goes on), then back again
        _same_batches(rows.batches(lo, hi, 3, max_tokens), whole.batches(lo, hi, 3, max_tokens))
    pick = [9, 2, 2, len(whole) - 1]
    _same_batches(rows.batches_of(pick, 3, max_tokens), _picked(whole, pick, max_tokens))


def _picked(whole, pick, max_tokens):
    """The rows ``pick`` of a dataset in memory, in batches of 3."""
    idx = torch.tensor(pick)
    inputs = ({k: v[idx] for k, v in whole.inputs.items()} if isinstance(whole.inputs, dict) else whole.inputs[idx])
    return TensorDataset(inputs, whole.labels[idx], name="picked").batches(0, len(pick), 3, max_tokens)


def test_a_dataloader_is_streamed_and_a_generator_is_not_reiterable():
    data = TorchRows(torch.randn(10, 6), torch.randint(0, 3, (10,)))
    loader = DataLoader(data, batch_size=4)
    assert is_reiterable(loader) and is_reiterable(_pairs())
    assert not is_reiterable(iter(_pairs())) and not is_reiterable(b for b in _pairs())
    rows = LoaderRows(loader, "train batches")
    assert rows.fingerprint() == collect_batches(loader, "train batches")[0].fingerprint()


def test_a_shuffling_dataloader_is_refused_naming_the_fix():
    data = TorchRows(torch.randn(10, 6), torch.randint(0, 3, (10,)))
    with pytest.raises(DataError, match=r"RandomSampler, another order on every pass; .*shuffle=False"):
        LoaderRows(DataLoader(data, batch_size=4, shuffle=True), "train batches")


def test_batches_that_change_between_passes_are_an_error():
    batches = _pairs(20, 5)
    rows = LoaderRows(batches, "train batches")
    del batches[-1]
    with pytest.raises(DataError, match="give the same rows on every pass"):
        list(rows.batches(0, 20, 5))


def test_many_windows_in_order_read_one_pass_without_piling_up():
    x, y = torch.arange(3000.0)[:, None], torch.zeros(3000, dtype=torch.int64)
    batches = [(x[i:i + 7], y[i:i + 7]) for i in range(0, 3000, 7)]
    rows = LoaderRows(batches, "train batches")
    got = torch.cat([rows.window(i, i + 1).inputs for i in range(3000)])  # every batch cut by a window
    assert torch.equal(got, x)
