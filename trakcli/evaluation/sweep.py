"""`trak eval sweep`: the LDS as a function of proj_dim, number of checkpoints and the ridge.

One set of retrained models (the ``eval/`` group of the config's store) serves every point of the grid, and each
proj_dim is featurized once (into ``<store>.sweep/<kind>_<d>.zarr``, or the config's own store for its
proj_dim): the number of checkpoints and the ridge only change the cheap last step, swept in memory.

For a proj_dim ``d`` and ridge ``λ``, each checkpoint's kernel is factored once
(:func:`trakcli.scoring.solve_kernel`, as `trak score` does), and the scores of the first ``k`` checkpoints are
:func:`trakcli.scoring.score_block` of their float32 target weights and features,
``[(1/k) Σ_{m<k} φ_m(t)ᵀ A_m(λ) Φ_mᵀ] ⊙ [(1/k) Σ_{m<k} Q_m]`` (Park et al. 2023, Eq. 17; docs/concepts.md):
the numbers `trak score` writes for that setting. When ``n_train < d`` the sweep solves in the dual
(:func:`trakcli.scoring.dual_scores`, float64 terms summed over the first ``k`` checkpoints; `trak score`
multiplies the stored solved features in float32, which agrees to ~1e-7 of the largest score). The dense
linear algebra runs with ``linalg_threads`` threads. Memory: every checkpoint's train features of one proj_dim
and one ``[n_target, n_train]`` score matrix at a time: benchmark-sized data (digits: 1437 × 1024 floats per
checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trakcli.config import Config
from trakcli.jobs.inputs import resolve_checkpoints
from trakcli.errors import ConfigError, ProjectorError, StoreMismatchError
from trakcli.jobs.featurize import featurize
from trakcli.evaluation.retrain import load_or_retrain
from trakcli.jobs.runtime import grad_memory_for, torch_threads
from trakcli.jobs.score import score
from trakcli.jobs.setup import build_featurizer
from trakcli.evaluation.lds import lds
from trakcli.models.build import build_model
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.scoring import (
    DUAL, dual_gram, dual_scores, ensemble_block, gram_matrix, kernel_form, score_block, solve_kernel, target_weights,
)
from trakcli.store.store import Store

DEFAULT_CHECKPOINT_GRID = (1, 2, 5, 10, 20, 50, 100, 200, 500)


@dataclass
class SweepResult:
    """The grid of a sweep and its LDS values.

    Attributes:
        rows: one dict per grid point: ``proj_dim``, ``n_checkpoints``, ``lambda_rel`` (None for an absolute ridge),
            ``lambda_reg`` (the absolute ridge given, or the mean λ_m the relative one gave), ``lds``, ``ci_low``,
            ``ci_high`` (95% bootstrap interval over targets), ``n_targets_nan``.
        best: the row of the highest LDS.
        default: the row of the config's own settings (its proj_dim, all
            checkpoints, its score.lambda_reg / lambda_rel).
        n_subsets, n_train, n_target: sizes of the ground truth.
        stores: proj_dim -> the store its features are in.
    """

    rows: list[dict[str, Any]]
    best: dict[str, Any]
    default: dict[str, Any]
    n_subsets: int
    n_train: int
    n_target: int
    stores: dict[int, str]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON data of the whole result."""
        return {
            "n_subsets": self.n_subsets, "n_train": self.n_train, "n_target": self.n_target,
            "best": self.best, "default": self.default,
            "gap_default_to_best": self.best["lds"] - self.default["lds"],
            "stores": {str(k): v for k, v in self.stores.items()},
            "rows": self.rows,
        }


def sweep_dir(cfg: Config) -> Path:
    """Where the sweep's per-proj_dim stores go: ``eval.sweep.dir`` or ``<store.path minus .zarr>.sweep``."""
    if cfg.eval.sweep.dir is not None:
        return Path(cfg.eval.sweep.dir)
    path = cfg.store.location
    return path.with_name(path.stem + ".sweep")


def checkpoint_grid(n_models: int, given: list[int] | None) -> list[int]:
    """Ensemble sizes to sweep: ``given`` (each at most ``n_models``, else a ConfigError), or 1, 2, 5, 10, ...
    and ``n_models``."""
    if given:
        too_big = [k for k in given if k > n_models]
        if too_big:
            raise ConfigError(f"eval.sweep.n_checkpoints: {too_big} exceed the {n_models} checkpoints the config "
                              f"lists; use sizes up to {n_models}")
        return sorted(set(given))
    return sorted({k for k in DEFAULT_CHECKPOINT_GRID if k < n_models} | {n_models})


def _config_for(cfg: Config, proj_dim: int, directory: Path) -> Config:
    """``cfg`` with another proj_dim and, unless it is the config's own proj_dim, a store in ``directory``."""
    if proj_dim == cfg.projector.proj_dim:
        return cfg
    projector = cfg.projector.model_copy(update={"proj_dim": proj_dim})
    store = cfg.store.model_copy(update={"path": directory / f"{cfg.projector.kind}_{proj_dim}.zarr"})
    return cfg.model_copy(update={"projector": projector, "store": store})


def _check_proj_dims(cfg: Config, dims: list[int], directory: Path) -> None:
    """Fail before any retraining when a grid proj_dim cannot be built (kronecker: wider than the layers allow):
    a ConfigError naming the proj_dim and the projector's limit."""
    if cfg.projector.kind != "kronecker":  # the other kinds take any proj_dim >= 1 (checked by the config)
        return
    model = build_model(cfg.model.entrypoint, **cfg.model.kwargs)
    for d in dims:
        try:
            c = _config_for(cfg, d, directory)
            build_featurizer(model, c.projector, grad_wrt=c.grad_wrt, task=c.task,
                             memory_mb=grad_memory_for(c.data.grad_memory_mb, "cpu"), gradient_method=c.gradient_method)
        except ProjectorError as e:
            raise ConfigError(f"eval.sweep.proj_dims: {d} cannot be used with projector kind kronecker: {e}") from None


def read_features(cfg: Config, n_models: int) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Train features ``[n_train, d]``, out_to_loss ``[n_train]`` and target features ``[n_target, d]`` per model.

    Read through the store's checked reads: an unfinished, missing or corrupt chunk stops with the repair command.
    """
    store = Store.open_existing(cfg.store.location, mode="r")
    exp = cfg.score.experiment
    phi, q, phi_t = [], [], []
    for m in range(n_models):
        phi.append(np.asarray(store.read(f"train/{m}/features"), dtype=np.float32))
        q.append(np.asarray(store.read(f"train/{m}/out_to_loss"), dtype=np.float64))
        phi_t.append(np.asarray(store.read(f"targets/{exp}/{m}/features"), dtype=np.float32))
    return phi, q, phi_t


Ridge = tuple[float | None, float | None]  # (lambda_rel, None) or (None, lambda_reg)


def lds_grid(cfg: Config, masks: np.ndarray, outputs: np.ndarray, ks: list[int], ridges: list[Ridge], *,
             own_store: bool = False, reporter: Reporter = NULL_REPORTER) -> list[dict[str, Any]]:
    """The LDS of one featurization (``cfg``'s projector) for every ensemble size and ridge.

    Featurizes ``cfg.checkpoints`` into ``cfg.store`` (done chunks are kept), runs ``trak score`` for the target
    features, then for each ridge factors each checkpoint's kernel once and scores the first ``k`` checkpoints for
    every ``k`` in ``ks`` (the formula is in this module's docstring). ``masks`` and ``outputs`` are
    :func:`~trakcli.evaluation.lds.lds`'s; a ridge is ``(lambda_rel, None)``, relative to trace(Φᵀ Φ)/n_train,
    or ``(None, lambda_reg)``. ``own_store``: ``cfg.store`` is the user's own store, and one made with other
    settings is an error; otherwise the store is a cache, featurized again when its settings differ.

    Returns:
        One row per (ridge, k), as :attr:`SweepResult.rows`.

    Raises:
        StoreMismatchError: ``own_store`` and the store was made with other settings; and what featurize
            and score raise.
    """
    d = cfg.projector.proj_dim
    n_models = max(ks)
    reporter.info(f"sweep: proj_dim {d} -> {cfg.store.path}")
    try:
        featurize(cfg, reporter=reporter)
    except StoreMismatchError:
        if own_store:
            raise  # the user's own store: never overwritten by a sweep
        # a sweep store is a cache of this command: made for another model, data or projector, redo it
        reporter.info(f"sweep: {cfg.store.path} was made with other settings; featurizing it again")
        featurize(cfg, overwrite=True, reporter=reporter)
    score(cfg, reporter=reporter)  # the target features (and the scores of the default ridge)
    phi, q, phi_t = read_features(cfg, n_models)
    n_train = phi[0].shape[0]
    phi_train = [torch.from_numpy(f) for f in phi]
    dual = kernel_form(n_train, d) == DUAL
    q_train = [torch.from_numpy(x) for x in q]
    rows: list[dict[str, Any]] = []
    with reporter.task(f"sweep proj_dim {d}", len(ridges)) as task, torch_threads(cfg.linalg_threads):
        grams = [dual_gram(f) if dual else gram_matrix([f]) for f in phi_train]
        for rel, absolute in ridges:
            lams, weights, totals, total = [], [], {}, None
            for m in range(n_models):
                factor, lam = solve_kernel(grams[m], n_train, absolute, rel if rel is not None else 1.0, d)
                if dual:  # float64 terms (`trak score`'s float32 Φ_t X_mᵀ differ by ~1e-7 of the largest)
                    total = dual_scores(factor, torch.from_numpy(phi_t[m]), phi_train[m], out=total)
                    if m + 1 in ks:
                        totals[m + 1] = total.clone()
                else:  # float32 weights, as the streamed scoring of `trak score` uses
                    weights.append(target_weights(factor, torch.from_numpy(phi_t[m]), dtype=torch.float32))
                lams.append(lam)
            for k in ks:
                if dual:
                    scores = ensemble_block(totals[k], q_train[:k]).numpy()  # [n_target, n_train]
                else:
                    scores = score_block(weights[:k], phi_train[:k], q_train[:k]).numpy()
                res = lds(scores, masks, outputs, n_bootstrap=cfg.eval.bootstrap, seed=cfg.eval.seed)
                rows.append({
                    "proj_dim": d, "n_checkpoints": k, "lambda_rel": rel,
                    "lambda_reg": absolute if absolute is not None else float(np.mean(lams[:k])),
                    "lds": float(res.lds), "ci_low": float(res.ci_low), "ci_high": float(res.ci_high),
                    "n_targets_nan": int(res.n_targets_nan),
                })
            task.advance()
    return rows


def sweep(cfg: Config, *, workers: int = 1, proj_dims: list[int] | None = None,
          n_checkpoints: list[int] | None = None, lambda_rel: list[float] | None = None,
          lambda_reg: list[float] | None = None, reporter: Reporter = NULL_REPORTER) -> SweepResult:
    """Measure the LDS over a grid of proj_dim × checkpoints × ridge.

    Args:
        cfg: the config (its ``eval`` section fixes the retraining; ``eval.sweep`` the grid).
        workers: processes for the retraining, if it is not in the store yet.
        proj_dims, n_checkpoints, lambda_rel, lambda_reg: override ``eval.sweep``'s grid. The config's own proj_dim
            and ridge are always added, so the default settings are a point of the grid.
        reporter: progress and messages.

    Returns:
        :class:`SweepResult`.

    Raises:
        ConfigError: a grid value the checkpoints cannot give; and whatever
            featurize, score and the retraining raise (StoreError, ...).
    """
    if cfg.curvature.kind != "gram":
        raise ConfigError("trak eval sweep varies TRAK's kernel (its ridge) over proj_dim and checkpoints; "
                          f"curvature.kind {cfg.curvature.kind} has no kernel: sweep curvature.damping by running "
                          "`trak featurize`, `trak score` and `trak eval lds` per value (each with its own "
                          "store.path), or set curvature.kind: gram")
    grid = cfg.eval.sweep
    dims = sorted(set(proj_dims or grid.proj_dims) | {cfg.projector.proj_dim})
    checkpoints = resolve_checkpoints(cfg)
    ks = checkpoint_grid(len(checkpoints), n_checkpoints if n_checkpoints is not None else grid.n_checkpoints)
    rels = list(lambda_rel if lambda_rel is not None else grid.lambda_rel)
    abss = list(lambda_reg if lambda_reg is not None else grid.lambda_reg)
    if cfg.score.lambda_reg is not None:
        abss = sorted(set(abss) | {cfg.score.lambda_reg})
    else:
        rels = sorted(set(rels) | {cfg.score.lambda_rel})
    ridges: list[Ridge] = [(r, None) for r in rels] + [(None, a) for a in abss]
    n_models = max(ks)

    directory = sweep_dir(cfg)
    _check_proj_dims(cfg, dims, directory)
    masks, outputs = load_or_retrain(cfg, workers=workers, reporter=reporter)
    rows: list[dict[str, Any]] = []
    stores: dict[int, str] = {}
    for d in dims:
        sub = _config_for(cfg, d, directory)
        if sub is not cfg:
            sub = sub.model_copy(update={"checkpoints": [str(p) for p in checkpoints[:n_models]]})
        rows += lds_grid(sub, masks, outputs, ks, ridges, own_store=sub is cfg, reporter=reporter)
        stores[d] = str(sub.store.path)
    best = max(rows, key=lambda r: r["lds"])
    default_ridge = ({"lambda_rel": None, "lambda_reg": cfg.score.lambda_reg} if cfg.score.lambda_reg is not None
                     else {"lambda_rel": cfg.score.lambda_rel})
    # the config's own settings use all its checkpoints (or the largest ensemble of a given grid)
    default = next(r for r in rows if r["proj_dim"] == cfg.projector.proj_dim and r["n_checkpoints"] == n_models
                   and all(r[k] == v for k, v in default_ridge.items()))
    return SweepResult(rows, best, default, int(masks.shape[0]), int(masks.shape[1]), int(outputs.shape[1]), stores)
