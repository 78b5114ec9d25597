"""The sections that make the features: ``projector:``, ``second_moment:``, ``curvature:`` (with its ``refine:``)
and ``store:``."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

from pydantic_core import PydanticCustomError
from pydantic import (
    ConfigDict, Field, PositiveInt, ValidationInfo, field_serializer, field_validator, model_validator,
)

from trakcli.errors import ProjectorError
from trakcli.projectors.registry import DEFAULT_KIND, IMPLEMENTATIONS, OPTIONS, kind_names, projector_kind
from trakcli.strict import NoBoolNumbers, StrictModel

#: Error type of a validator that finds keys no field takes (ctx: ``keys``, ``choices``); reported
#: like pydantic's ``extra_forbidden``, one line per key with a did-you-mean.
UNKNOWN_KEYS = "unknown_keys"


def _kind_description() -> str:
    """The ``projector.kind`` description: the registered kinds at import, the default first."""
    default = "; the default: the LDS of dense rademacher at a fraction of its cost, docs/guides/projectors.md"
    kinds = sorted(kind_names(), key=lambda n: n != DEFAULT_KIND)
    described = [f"{n} ({projector_kind(n).summary}{default if n == DEFAULT_KIND else ''})" for n in kinds]
    return "; ".join(described) + ". A kind registered with trakcli.projectors.register_projector_kind is accepted too."


class ProjectorConfig(NoBoolNumbers):
    """The random projection.

    ``kind`` names a registered projector kind (:mod:`trakcli.projectors.registry`). For a kind
    built from a gradient dimension the mapping is passed to ``make_projector``; keys beyond
    those listed are options (``block_size``, ``max_chunk_size``, a kind's own ones such as
    sjlt's ``s`` ...) validated by the projector itself.

    A kind built from the model (``kind: kronecker``, LoGra, Choe et al. 2024, projects each
    covered layer's gradient with ``P_out ⊗ P_in`` from the layer's inputs and output
    gradients, :class:`trakcli.gradients.KroneckerFeaturizer`) checks ``implementation`` itself
    (kronecker has a single one, so ``implementation`` other than ``auto`` is refused), and
    its only options are the kind's own (:data:`trakcli.projectors.kinds.KRONECKER_OPTIONS`).
    """

    model_config = ConfigDict(extra="allow")

    kind: str = Field(DEFAULT_KIND, description=_kind_description())
    implementation: str = Field(
        "auto", description=f"{', '.join(IMPLEMENTATIONS)} (each kind supports some; kind kronecker: auto only)."
    )
    proj_dim: PositiveInt = Field(2048, description="Output dimension of the projection.")
    seed: int = Field(0, description="Seed of the random matrix (per model_id matrices derive from it).")

    @field_validator("kind")
    @classmethod
    def _registered_kind(cls, v: str) -> str:
        try:
            projector_kind(v)
        except ProjectorError as e:
            raise ValueError(str(e)) from None
        return v

    @field_validator("implementation")
    @classmethod
    def _kind_implementation(cls, v: str, info: ValidationInfo) -> str:
        kind = info.data.get("kind")
        problem = projector_kind(kind).implementation_error(v) if kind is not None else None
        if problem:
            raise ValueError(problem)
        return v

    @property
    def built_from_model(self) -> bool:
        """Whether ``kind`` is built from the model (``kronecker``), not by ``make_projector``."""
        return projector_kind(self.kind).built_from_model is not None

    @model_validator(mode="after")
    def _known_options(self) -> "ProjectorConfig":
        """Unknown keys (no field and no option of the kind; for a kind built from the model, closer to a field
        than to its options) get the did-you-mean of every other config key; a kind built from the model refuses
        its other keys naming its options."""
        extra = list(self.model_extra or {})
        if not extra:
            return self
        fields = list(type(self).model_fields)
        own = projector_kind(self.kind).options
        if self.built_from_model:
            choices = fields + list(own)
            closest = {k: difflib.get_close_matches(k, choices, n=1) for k in extra if k not in own}
            unknown = [k for k, close in closest.items() if close and close[0] in fields]
        else:
            choices = fields + list(OPTIONS)
            unknown = [k for k in extra if k not in OPTIONS]
            for k in unknown:
                owners = [n for n in kind_names() if projector_kind(n).built_from_model and k in projector_kind(n).options]
                if owners:
                    raise ValueError(f"option {k} applies to kind {' or '.join(owners)} only; remove it or set "
                                     f"projector.kind: {owners[0]}")
        if unknown:
            raise PydanticCustomError(UNKNOWN_KEYS, "unknown keys {keys}", {"keys": unknown, "choices": choices})
        others = [k for k in extra if k not in own] if self.built_from_model else []
        if others:
            close = {k: difflib.get_close_matches(k, list(own), n=1) for k in others}
            shown = [f"{k} (did you mean {c[0]}?)" if c else k for k, c in close.items()]
            known = "; ".join(f"{k}: {v}" for k, v in own.items())
            if len(others) == 1:
                head = f"option {shown[0]} does not apply to kind {self.kind}; remove it"
            else:
                head = f"options {', '.join(shown)} do not apply to kind {self.kind}; remove them"
            raise ValueError(f"{head}. kind {self.kind} takes proj_dim, seed and {known}")
        return self

    def options(self) -> dict[str, Any]:
        """All keys, as the keyword arguments of ``make_projector`` (not for a kind built from the model)."""
        return self.model_dump()

    def kronecker_options(self) -> dict[str, Any]:
        """``proj_dim``, ``seed`` and the given options of the kind, as keyword arguments of
        :class:`trakcli.gradients.KroneckerFeaturizer`."""
        own = projector_kind(self.kind).options
        extra = {k: v for k, v in (self.model_extra or {}).items() if k in own}
        return {"proj_dim": self.proj_dim, "seed": self.seed, **extra}


class KindSection(StrictModel):
    """A section whose value may be its kind alone: ``second_moment: adafactor`` is
    ``second_moment: {kind: adafactor}``, ``curvature: ekfac`` is ``curvature: {kind: ekfac}``."""

    @model_validator(mode="before")
    @classmethod
    def _kind_alone(cls, raw: Any) -> Any:
        return {"kind": raw} if isinstance(raw, str) else raw


class SecondMomentConfig(KindSection):
    """``second_moment:``: the optimizer second-moment correction of the per-example gradients (TrackStar).

    Each per-example gradient is divided elementwise by the square root of the bias-corrected second-moment estimate
    ``v`` (``exp_avg_sq``) that Adam/AdamW kept for that checkpoint, before it is projected, so the features live in
    the geometry the optimizer used (Chang et al., ICLR 2025, "Scalable Influence and Fact Tracing for Large
    Language Model Pretraining", Sec. 3). ``adafactor`` uses the rank-1 factorization of ``v`` per layer (Shazeer &
    Stern 2018), a diagonal scaling on each side of the layer's gradient matrix, which the Kronecker projection
    applies to its factors; ``adam`` the exact ``1/sqrt(v + eps)`` (needs whole per-example gradients: not kind
    kronecker). README "Optimizer second-moment correction" gives the formulas.
    """

    kind: Literal["adafactor", "adam"] | None = Field(
        None, description="null: no correction (TRAK). adafactor: G -> D_out G D_in per layer with D_out = (row means "
        "of v + eps)^-1/2, D_in = (mean of v + eps)^1/2 (column means of v + eps)^-1/2 (the bias is one more column; "
        "vectors outside layers: elementwise); every projector kind. adam: G / sqrt(v + eps) elementwise; every kind "
        "but kronecker.",
    )
    optimizer_state: str | list[str] | None = Field(
        None, description="The optimizer state file of each checkpoint, in model_id order: a glob (sorted) or a list. "
        "Unset: for checkpoints from a manifest.json, the file its entry records; otherwise <checkpoint's "
        "folder>/optimizer_state/<checkpoint's file name>, where `trak optimize` with optimize.save_optimizer_state: "
        "true writes it.",
    )
    eps: float | None = Field(
        None, ge=0, description="Added to the second moments (inside the square root). Unset: the saved optimizer's "
        "eps squared (AdamW adds eps to sqrt(v)), so 1e-16 for AdamW's default.",
    )

    @field_validator("optimizer_state", mode="before")
    @classmethod
    def _paths(cls, v: Any) -> Any:
        return str(v) if isinstance(v, Path) else v


class RefineConfig(StrictModel):
    """``curvature.refine``: conjugate gradients on each target's (G + D) x = g_t (docs/guides/curvature.md)."""

    iterations: int = Field(
        0, ge=0, description="Most conjugate-gradient steps per target (0: the curvature's own solve, no refinement). "
        "Each step costs one Gauss-Newton-vector product over `samples` train rows.",
    )
    samples: PositiveInt = Field(
        256, description="Train rows (a seeded random subset, curvature.seed) over which the Gauss-Newton matrix is "
        "taken.",
    )
    tol: float = Field(1e-4, gt=0, lt=1, description="Stop a target's iterations when its residual norm is below "
                       "tol times its gradient's.")

    def spec(self) -> dict[str, Any] | None:
        """What the target features depend on (None: no refinement)."""
        return None if self.iterations == 0 else {"iterations": self.iterations, "samples": self.samples,
                                                  "tol": self.tol}


class CurvatureConfig(KindSection):
    """``curvature:``: the preconditioner of the scores (docs/guides/curvature.md).

    ``gram`` is TRAK's kernel (Φᵀ Φ + λ I)⁻¹ of the projected train features (``score.lambda_*``). ``kfac`` and
    ``ekfac`` fit, per checkpoint, per-layer Kronecker factors of the Fisher (Martens & Grosse 2015) and, for
    ``ekfac``, its eigenvalues corrected in their eigenbasis (George et al. 2018; Grosse et al. 2023); every
    gradient, train and target, is whitened by the damped inverse before it is projected, so scores are inner
    products of ``proj_dim`` floats and approximate g_tᵀ (F + δ I)⁻¹ g_z. Fit over the training data, stored per
    checkpoint in the store (resumable).
    """

    kind: Literal["gram", "kfac", "ekfac"] = Field(
        "gram",
        description="gram: TRAK's kernel over the projected features. kfac / ekfac: Kronecker-factored Fisher "
        "(ekfac: eigenvalue-corrected) per linear, convolution or embedding layer, fitted from layer hooks; with "
        "grad_wrt unset, every linear and convolution layer it can factor (one info line names what is left out). "
        "The projector is kind kronecker unless set (the curvature folded into its per-layer factors).",
    )
    output: Literal["loss", "margin"] = Field(
        "loss",
        description="kfac / ekfac: the function whose gradients are scored. loss: each example's training loss "
        "(summed token cross-entropy for a language model, cross-entropy for a classifier), as influence "
        "functions and kronfluence define them, no out-to-loss weighting. margin: TRAK's margin times its "
        "out-to-loss term.",
    )
    query_rank: int | None = Field(
        None, ge=1, description="kfac / ekfac exact scores: rank each target's preconditioned per-layer gradient is "
        "kept at (truncated SVD; kronfluence's query_gradient_low_rank). None: full rank where every target fits "
        "data.grad_memory_mb, else the largest rank that fits (said in an info line).",
    )
    fit_rows: int | None = Field(
        None, ge=1, description="kfac / ekfac: fit the curvature on a seeded random sample of this many train rows "
        "(curvature.seed) instead of all of them; None: every train row.",
    )
    damping: float = Field(
        1e-5, gt=0, description="kfac / ekfac: each layer's damping of the influence, δ = damping x the mean of its "
        "eigenvalues, in exact scores and the refinement (1e-5 to 1e-4 scored best; kronfluence's default is an "
        "absolute 1e-8).",
    )
    exact: bool = Field(
        True, description="kfac / ekfac: `trak score` takes exact influences g(t)ᵀ (F + δ)⁻¹ g(z): each target's "
        "preconditioned layer gradients once (query_rank), then one hooked forward + backward over the train rows "
        "meets every target per layer and streams into the top-k or the score matrix (resumable by chunk, split over "
        "torchrun ranks); with score.rescore_multiplier only the candidates of the stored features are re-scored so. "
        "false: inner products of the stored proj_dim features (corpus scale), whitened with feature_damping.",
    )
    feature_damping: float = Field(
        0.1, gt=0, description="kfac / ekfac: the damping (x the mean eigenvalue, per layer) of the whitening of the "
        "stored projected features; the projection's error grows as it shrinks (0.1 to 0.3 scored best at proj_dim "
        "4096).",
    )
    fisher: Literal["true", "empirical"] = Field(
        "true",
        description="kfac / ekfac: true: gradients at labels sampled from the model's own predictions (the "
        "Fisher); empirical: at the data's labels.",
    )
    seed: int = Field(0, ge=0, description="kfac / ekfac: seed of the sampled labels and of the refinement's sample.")
    refine: RefineConfig = Field(
        default_factory=lambda: RefineConfig(),
        description="kfac / ekfac: conjugate-gradient refinement of each target's inverse-Hessian-vector product "
        "with the Gauss-Newton matrix, preconditioned by the fitted curvature (`trak score`; iterations 0: off).",
    )

    def spec(self) -> dict[str, Any] | None:
        """What the stored features depend on (part of the store identity); None for ``gram``, which changes only the
        kernel. ``damping`` and ``exact`` change only the scores (the experiment's settings)."""
        if self.kind == "gram":
            return None
        spec = {"kind": self.kind, "feature_damping": self.feature_damping, "fisher": self.fisher, "seed": self.seed}
        if self.output != "margin":  # stores made before the key existed scored the margin
            spec["output"] = self.output
        if self.fit_rows is not None:
            spec["fit_rows"] = self.fit_rows
        return spec

    @model_validator(mode="after")
    def _refine_needs_curvature(self) -> "CurvatureConfig":
        if self.kind == "gram" and self.refine.iterations:
            raise ValueError("curvature.refine.iterations refines a kfac or ekfac solve; set curvature.kind: ekfac "
                             "(or kfac), or curvature.refine.iterations: 0")
        return self


class StoreConfig(StrictModel):
    """Where and how features and scores are written."""

    path: Path | str = Field(
        description="The Zarr store: a local directory (out/attrib.zarr) or an object store URL "
        "(s3://bucket/prefix/attrib.zarr; credentials and endpoint from the AWS_* environment variables, see "
        "storage_options)."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the file system of a store.path URL (fsspec; for s3:// those of "
        "s3fs.S3FileSystem, e.g. {endpoint_url: http://127.0.0.1:8333, key: ..., secret: ...}); over the "
        "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_REGION environment variables. "
        "Secrets are never written to the store or printed.",
    )
    chunk_rows: PositiveInt = Field(
        512, description="Rows per chunk of features/scores; the unit of resume (done flags)."
    )
    save_every_s: float = Field(
        30.0, ge=0, description="Seconds of work between two saves of the train rows computed so far in a chunk not "
        "yet done (their count goes to train/<model_id>/rows_done), so that a killed `trak featurize` loses at most "
        "about this much work and the rerun starts after the saved rows; Ctrl-C saves them at once. 0: after every "
        "batch. Each save rewrites the chunk's file: keep it well above the time one save takes.",
    )
    dtype: Literal["float32", "float16", "bfloat16", "int8", "binary"] = Field(
        "float32",
        description="Storage dtype of train and target features: float16 or bfloat16 halve the disk (bfloat16 "
        "keeps float32's range, float16 three more bits of precision); compute stays float32, kernels float64. "
        "int8 (per-row scale) or binary (1-bit signs, per-row scale) add compressed codes beside a bfloat16 copy: "
        "score.top_k then finds candidates from the codes and re-ranks them exactly from the bfloat16 copy "
        "(two-stage top-k); the kernel and the full score matrix use the bfloat16 copy.",
    )
    compressor: Literal["zstd", "blosc", "none"] = Field(
        "zstd", description="Compression codec of every array (each chunk also carries a CRC32C checksum)."
    )

    @field_validator("path", mode="before")
    @classmethod
    def _names_a_directory(cls, v: Any) -> Any:
        """The store is a directory (or prefix) of its own, its lock beside it: a URL stays text (opened when a
        command uses the store), anything else is a local :class:`Path`."""
        from trakcli.store.location import broken_url, is_url

        if isinstance(v, str) and (scheme := broken_url(v)):
            rest = v.split(":", 1)[1].lstrip("/")
            raise ValueError(f"{v!r} reads as a {scheme}:// URL missing a slash; write {scheme}://{rest} (a local "
                             f"folder named '{v.split(':', 1)[0]}:' is never made of it)")
        if isinstance(v, str) and v[:7].lower() == "file://":
            v = v[7:]
        if isinstance(v, str) and is_url(v):
            name = v.split("://", 1)[1].rstrip("/").rsplit("/", 1)[-1]
            if not name or name in (".", ".."):
                raise ValueError("must name the store's own prefix below the bucket, e.g. "
                                 "store.path=s3://bucket/attrib.zarr")
            return v.rstrip("/")
        if not isinstance(v, (str, Path)):
            return v
        path = Path(v)
        if not path.name or path.name == "..":
            raise ValueError("must name the store's own directory (its lock file goes beside it), not '.', '..' or a "
                             "root; e.g. store.path=out/attrib.zarr")
        return path

    @field_serializer("storage_options")
    def _hide_secrets(self, v: dict[str, Any]) -> dict[str, Any]:
        """Credentials in ``storage_options`` are masked wherever the config is written or printed."""
        return _masked(v)

    @property
    def location(self) -> Any:
        """The store as a :class:`~pathlib.Path`, or a :class:`upath.UPath` for a URL (:class:`StoreError`: no
        installed file system opens it)."""
        from trakcli.store.location import store_location

        return store_location(self.path, self.storage_options)


_SECRET = ("secret", "token", "password", "key", "credential")


def _masked(v: Any) -> Any:
    """``v`` with the values of secret-like keys (``key``, ``secret``, ``token``, ...) replaced by ``"***"``."""
    if isinstance(v, dict):
        return {k: "***" if isinstance(k, str) and any(s in k.lower() for s in _SECRET) and not isinstance(val, dict)
                else _masked(val) for k, val in v.items()}
    return v
