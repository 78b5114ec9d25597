"""The store in the ecosystem: xarray opens its groups with named dimensions."""

from __future__ import annotations

import pytest

from projects import invoke as trak


@pytest.mark.filterwarnings("ignore:Failed to open Zarr store with consolidated metadata")
def test_xarray_opens_the_store_with_named_dimensions(user_project):
    xarray = pytest.importorskip("xarray")
    assert trak("featurize", "run.yaml", "-q").exit_code == 0
    assert trak("score", "run.yaml", "-q").exit_code == 0
    ds = xarray.open_zarr("out/attrib.zarr", group="train/0")
    assert ds["features"].dims == ("train", "proj") and ds["features"].shape == (40, 16)
    assert ds["out_to_loss"].dims == ("train",) and ds["done"].dims == ("chunk",)
    scores = xarray.open_zarr("out/attrib.zarr", group="scores/default", consolidated=False)["scores"]
    assert scores.dims == ("target", "train") and scores.shape == (7, 40)
    targets = xarray.open_zarr("out/attrib.zarr", group="targets/default/0", consolidated=False)
    assert targets["features"].dims == ("target", "proj")
