"""The score plan: what one `trak score` run computes, settled once from ``score:`` and passed, with the run's
:class:`RunFlags`, to :func:`trakcli.jobs.score.score_targets` (by `trak score`, :func:`trakcli.score` and
:class:`trakcli.Attributor`); nothing below re-spells the config as keywords."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from trakcli.jobs.kernels import ridge_settings

if TYPE_CHECKING:
    from trakcli.config.schema import ScoreConfig
    from trakcli.jobs.setup import JobSetup


@dataclass(frozen=True)
class RunFlags:
    """How a run treats what is already in the store, not what it computes.

    Attributes:
        overwrite: recompute the experiment's target features and scores (only its scores when they are stale:
            train rows were appended since, :mod:`trakcli.store.append`).
        skip_nonfinite: give targets with non-finite gradients zero features (zero scores).
        verify: read every chunk of the train features and recompute target and score chunks that fail their checksum.
    """

    overwrite: bool = False
    skip_nonfinite: bool = False
    verify: bool = False


@dataclass(frozen=True)
class ScorePlan:
    """What one experiment's scores are: the keys of ``score:`` as one run resolves them.

    Attributes:
        experiment: ``score.experiment``, the store group of the targets and scores.
        lambda_reg, lambda_rel: the ridge (:func:`trakcli.scoring.resolve_lambda`).
        top_k: ``score.top_k`` (None: no top-k arrays).
        full: whether the full ``[n_target, n_train]`` matrix is stored (``score.full``; unset: when ``top_k`` is None).
        normalize: ``score.normalize``: None (TRAK's scores) or ``"unit"`` (cosines).
        per_token: ``score.per_token``.
        rescore_multiplier, recall_queries, rerank: the two-stage top-k's settings (:mod:`trakcli.topk`).
        linalg_threads: torch threads of the kernels and score products (None: the runtime's default).
        grad_memory_mb: memory of the exact curvature scores' per-layer query gradients (resolved for the device).
        curvature: the features are whitened by a curvature (``curvature.kind`` kfac or ekfac): no kernel,
            λ_m reported as 0. Set by :meth:`for_setup`.
        exact_damping: with ``curvature.exact``, the damping of the exact scores (:mod:`trakcli.jobs.exact`); else None.
    """

    experiment: str = "default"
    lambda_reg: float | None = None
    lambda_rel: float = 1.0  # ScoreConfig's default (tests/jobs/test_plan.py checks they agree)
    top_k: int | None = None
    full: bool = True
    normalize: str | None = None
    per_token: bool = False
    rescore_multiplier: int | None = None
    recall_queries: int = 16
    rerank: str = "auto"
    linalg_threads: int | None = None
    grad_memory_mb: int = 1024
    curvature: bool = False
    exact_damping: float | None = None

    @classmethod
    def of(cls, sc: ScoreConfig, *, linalg_threads: int | None = None, grad_memory_mb: int = 1024) -> ScorePlan:
        """The plan of a validated ``score:`` section (``full`` resolved from ``top_k`` when unset)."""
        return cls(experiment=sc.experiment, lambda_reg=sc.lambda_reg, lambda_rel=sc.lambda_rel, top_k=sc.top_k,
                   full=sc.top_k is None if sc.full is None else sc.full, normalize=sc.normalize,
                   per_token=sc.per_token, rescore_multiplier=sc.rescore_multiplier, recall_queries=sc.recall_queries,
                   rerank=sc.rerank, linalg_threads=linalg_threads, grad_memory_mb=grad_memory_mb)

    def for_setup(self, s: JobSetup) -> ScorePlan:
        """This plan with what the setup decides: whether the features are whitened by a curvature, and the exact
        scores' damping."""
        return replace(self, curvature=s.curvature is not None,
                       exact_damping=s.exact_damping if s.curvature is not None else None)

    @property
    def exact(self) -> bool:
        """The scores are recomputed exactly from the hooks (``curvature.exact``, :mod:`trakcli.jobs.exact`)."""
        return self.curvature and self.exact_damping is not None

    @property
    def exact_two_stage(self) -> int | None:
        """``score.rescore_multiplier`` when the exact top-k re-scores candidates from the stored features."""
        return self.rescore_multiplier if self.exact and self.top_k and not self.full else None

    @property
    def unit(self) -> bool:
        """Cosine scores (``score.normalize: unit``)."""
        return self.normalize == "unit"

    def ridge(self) -> dict[str, float | None]:
        """The ridge settings a stored kernel is made with and checked against."""
        return ridge_settings(self.lambda_reg, self.lambda_rel)

    def settings(self, target_attrs: dict[str, Any]) -> dict[str, Any]:
        """What the experiment's scores depend on (recorded with them, checked on every run): the ridge, the
        normalization, ``target_attrs`` (target data, checkpoints, ...) and the exact scores' settings."""
        out: dict[str, Any] = {**self.ridge(), **target_attrs, "normalize": self.normalize}
        if self.exact:
            out["curvature_exact"] = {"damping": self.exact_damping}
            if self.exact_two_stage:
                out["curvature_exact"]["rescore_multiplier"] = self.exact_two_stage
        return out
