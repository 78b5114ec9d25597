"""The projector kind registry: a kind is one ProjectorKind class and one registration."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import trakcli
from trakcli.config import load_config
from trakcli.errors import ConfigError, ProjectorError
from trakcli.projectors import KINDS, OPTIONS, Projector, make_projector
from trakcli.projectors.base import flatten_grads
from trakcli.projectors.registry import (
    ProjectorKind,
    kind_names,
    projector_kind,
    register_projector_kind,
    unregister_projector_kind,
)

from projects import arrays


class Truncate(Projector):
    """The first ``proj_dim`` gradient coordinates times ``scale``."""

    implementation = "basic"

    def __init__(self, grad_dim: int, proj_dim: int, scale: float):
        super().__init__(grad_dim, proj_dim)
        self.scale = scale

    def spec(self) -> dict:
        return {"kind": "mykind", "grad_dim": self.grad_dim, "proj_dim": self.proj_dim, "seed": 0,
                "dtype": "float32", "scale": self.scale}

    def _project(self, grads, model_id: int) -> torch.Tensor:
        return flatten_grads(grads, self.grad_dim)[:, : self.proj_dim].float() * self.scale

    def _unproject(self, z: torch.Tensor, model_id: int) -> torch.Tensor:
        out = torch.zeros(z.shape[0], self.grad_dim, dtype=torch.float32, device=z.device)
        out[:, : self.proj_dim] = z.float() * self.scale
        return out


class MyKind(ProjectorKind):
    name = "mykind"
    summary = "the first proj_dim gradient coordinates, scaled"
    options = {"scale": "factor of every feature, a number > 0 (default 1.0)"}
    implementations = ("basic",)

    def __init__(self, *, scale: float = 1.0, **common):
        super().__init__(**common)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
            raise ProjectorError(f"projector option scale must be a number > 0, got {scale!r}; e.g. scale: 2.0")
        if self.proj_dim > self.grad_dim:
            raise ProjectorError(f"kind mykind keeps proj_dim={self.proj_dim} of grad_dim={self.grad_dim} coordinates")
        self.scale = float(scale)

    def build(self, implementation, *, cache_bytes, block_size, max_chunk_size):
        return Truncate(self.grad_dim, self.proj_dim, self.scale)


@pytest.fixture
def mykind():
    register_projector_kind(MyKind)
    yield MyKind
    unregister_projector_kind("mykind")


def test_a_registered_kind_is_built_by_make_projector(mykind):
    g = torch.randn(5, 10)
    proj = make_projector(kind="mykind", grad_dim=10, proj_dim=3, scale=2.0)
    assert isinstance(proj, Truncate) and proj.spec()["kind"] == "mykind"
    assert torch.equal(proj.project(g), g[:, :3] * 2.0)
    assert "mykind" in KINDS and "mykind" in kind_names() and projector_kind("mykind") is MyKind
    assert OPTIONS["scale"].startswith("mykind: ")
    with pytest.raises(ProjectorError, match="scale must be a number > 0, got -1"):
        make_projector(kind="mykind", grad_dim=10, proj_dim=3, scale=-1)
    with pytest.raises(ProjectorError, match="projector kind 'mykind' has no chunked implementation; "
                                             "use implementation: basic or auto"):
        make_projector(kind="mykind", implementation="chunked", grad_dim=10, proj_dim=3)
    with pytest.raises(ProjectorError, match="option s=2 only applies to kind 'sjlt', not 'mykind'"):
        make_projector(kind="mykind", grad_dim=10, proj_dim=3, s=2)
    with pytest.raises(ProjectorError, match="option scale=2.0 only applies to kind 'mykind', not 'sjlt'"):
        make_projector(kind="sjlt", grad_dim=10, proj_dim=3, scale=2.0)
    with pytest.raises(ProjectorError, match="'mykind' needs proj_dim"):
        make_projector(kind="mykind", grad_dim=10)


def test_a_registered_kind_featurizes_a_project_from_its_config(mykind, user_project):
    cfg = load_config(user_project / "run.yaml",
                      ["projector.kind=mykind", "projector.proj_dim=4", "projector.scale=2.0"])
    assert cfg.projector.kind == "mykind" and cfg.projector.options()["scale"] == 2.0
    trakcli.featurize(cfg)
    noop = load_config(user_project / "run.yaml", ["projector.kind=noop", "store.path=out/noop.zarr"])
    trakcli.featurize(noop)
    mine, full = arrays(user_project / "out/attrib.zarr"), arrays(user_project / "out/noop.zarr")
    for model_id in (0, 1):
        got, grads = mine[f"train/{model_id}/features"], full[f"train/{model_id}/features"]
        assert got.shape == (40, 4)
        np.testing.assert_allclose(got, grads[:, :4] * 2.0, rtol=1e-6, atol=1e-7)


def test_an_unregistered_kind_is_unknown_to_make_projector_and_the_config(user_project):
    register_projector_kind(MyKind)
    unregister_projector_kind("mykind")
    assert "mykind" not in KINDS
    with pytest.raises(ProjectorError, match=r"unknown projector kind 'mykind'.*choose one of noop, rademacher"):
        make_projector(kind="mykind", grad_dim=10, proj_dim=3)
    with pytest.raises(ConfigError, match="projector.kind: unknown projector kind 'mykind'"):
        load_config(user_project / "run.yaml", ["projector.kind=mykind"])
    with pytest.raises(ProjectorError, match="no projector kind 'mykind' is registered"):
        unregister_projector_kind("mykind")


def test_the_config_checks_the_kind_against_the_registry(user_project):
    with pytest.raises(ConfigError, match=r"projector.kind: unknown projector kind 'rademacher_' "
                                          r"\(did you mean 'rademacher'\?\)"):
        load_config(user_project / "run.yaml", ["projector.kind=rademacher_"])
    with pytest.raises(ConfigError, match="unknown projector kind 'gaussian'; choose one of noop, rademacher, normal, "
                                          "sjlt, kronecker"):
        load_config(user_project / "run.yaml", ["projector.kind=gaussian"])
    assert load_config(user_project / "run.yaml", ["projector.kind=kronecker"]).projector.built_from_model
    assert not load_config(user_project / "run.yaml", []).projector.built_from_model


def test_bad_registrations_are_refused():
    class Clash(ProjectorKind):
        name = "sjlt"

    class Nameless(ProjectorKind):
        pass

    class Triton(ProjectorKind):
        name = "triton_kind"
        implementations = ("basic", "triton")

    class Common(ProjectorKind):
        name = "common_kind"
        options = {"dtype": "again"}

    with pytest.raises(ProjectorError, match="'sjlt' is already registered"):
        register_projector_kind(Clash)
    with pytest.raises(ProjectorError, match="needs a name"):
        register_projector_kind(Nameless)
    with pytest.raises(ProjectorError, match="lists implementation 'triton'"):
        register_projector_kind(Triton)
    with pytest.raises(ProjectorError, match="declares option 'dtype', which every kind has"):
        register_projector_kind(Common)
    with pytest.raises(ProjectorError, match="takes a ProjectorKind subclass"):
        register_projector_kind(object)
    assert kind_names() == ("noop", "rademacher", "normal", "sjlt", "kronecker")
