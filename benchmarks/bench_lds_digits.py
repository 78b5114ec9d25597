#!/usr/bin/env python
"""Quality and speed of trakcli against MadryLab's ``traker`` on digits MLPs, each as its users run it.

What it measures:

* **Speed, trakcli as a user runs it**: ``trak featurize CONFIG ...`` and
  ``trak score CONFIG ...`` as two processes (the ``trak`` script of this
  environment, run from the repo root, on a fresh store), wall seconds of
  each, minus two interpreter + ``import torch`` start-ups (the median wall
  time of ``python -c "import torch"``, sampled before, between and after the
  timed runs of this same run). trakcli keeps its config's ``data.batch_size``
  and ``num_threads``. Rows: the config's own projector kind (digits.yaml:
  sjlt) with ``projector.proj_dim`` overridden, and ``projector.kind=kronecker``.
* **Speed, trakcli in process** (second column, ``--no-in-process`` skips
  it): ``trakcli.jobs.featurize`` then ``score`` called in this process with
  the same overrides; the scores must equal the CLI's.
* **Speed, traker as its users run it**: one process, ``TRAKer`` with a CPU
  ``BasicProjector`` (rademacher, float32, traker's block_size 100), batch
  100, the timer around load_checkpoint / featurize / finalize_features /
  start_scoring_checkpoint / score / finalize_scores, on the same checkpoints
  and ``proj_dim``. torch._dynamo (imported by the first ``torch.func`` call)
  is imported before traker's timer: that favours the baseline.
* **Quality**: the linear datamodeling score (LDS, Park et al. 2023, Sec. 2.2),
  computed by ``trakcli.evaluation.retrain`` and ``trakcli.evaluation.lds`` exactly as ``trak eval lds`` computes it:
  ``n_subsets`` models are retrained with the config's recipe (the same
  hyperparameters as the checkpoints) on random halves of the training set
  (``trakcli.evaluation.retrain.retrain``); for every target the Spearman correlation between
  the predicted margins ``mask @ scores[t]`` and the retrained models' actual
  margins ``logit_y - logsumexp_{j != y} logit_j`` is taken, and LDS is their
  mean (``trakcli.evaluation.lds.lds``).

Models (``--models``): ``small``, the config's MLP (digits.yaml: 2 hidden
layers of 128, 26k parameters, all ``optimize.n_models`` checkpoints), and
``large``, :data:`LARGE_MLP` (2 hidden layers of 256, 85k parameters,
``--large-n-checkpoints`` checkpoints, default 3: traker's BasicProjector
regenerates its projection matrix block by block for every batch, so its time
grows with grad_dim x proj_dim x batches).

The checkpoints come from ``trakcli.jobs.optimize`` with the config's
``optimize`` section; they are cached under ``--work-dir/<model>``, and the
retrained models in ``<work-dir>/<model>/lds_eval.zarr``, so reruns only
repeat the timed part.

Run it in the benchmark environment (``./benchmarks/env.sh`` makes it)::

    .venv-bench/bin/python -m benchmarks.bench_lds_digits            # full: both models, 100 subset models
    .venv-bench/bin/python -m benchmarks.bench_lds_digits --quick    # smoke run (20 models, 3 checkpoints)
    .venv-bench/bin/python -m benchmarks.bench_lds_digits --skip-traker   # trakcli only (no traker installed)

It prints a table (ratio = traker seconds / trakcli seconds) and writes JSON
(``--out``) with both LDS values, every wall time, the start-up samples and
the load average. Goals, for the config's projector: trakcli
>= 2.5x faster than traker at proj_dim 256 and 2048, LDS >= traker's, and
``trak score`` at proj_dim 2048 <= 2 s of compute (its wall minus one
start-up). ``--check`` makes a failed acceptance exit 1.

Timings are wall-clock; on a machine shared with other jobs they swing by
2-4x (the start-up too), so run it idle and read the load average in the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (atomic; adds date, commit, version, machine)
from benchmarks.launch import trak_command  # noqa: E402

DEFAULT_CONFIG = REPO / "configs" / "digits.yaml"
DEFAULT_WORK = REPO / "bench_results" / "lds_digits_work"
DEFAULT_OUT = REPO / "bench_results" / "lds_digits.json"

# The goals of the comparison.
MIN_SPEEDUP = 2.5  # traker seconds / trakcli seconds (as users run them), default projector, proj_dim 256 and 2048
MAX_SCORE_2048 = 2.0  # seconds of `trak score` compute at proj_dim 2048 (wall minus start-up)

# The larger MLP: 2 hidden layers of 256 (85k parameters, 3.3x the config's 26k). traker's
# BasicProjector regenerates its [grad_dim, block_size] matrix block by block for every batch, so its
# time grows with grad_dim x proj_dim x batches; at hidden 512 x 3 layers (564k parameters) one
# checkpoint at proj_dim 2048 would take minutes, hence also only LARGE_N_CHECKPOINTS checkpoints.
LARGE_MLP = {"in_dim": 64, "hidden_dim": 256, "num_classes": 10, "depth": 2}
LARGE_N_CHECKPOINTS = 3
TRAKER_BATCH_SIZE = 100  # the batch size of traker's examples; trakcli keeps its config's data.batch_size


@contextlib.contextmanager
def torch_threads(n: int):
    """Run a block with n torch intra-op threads, then restore the count.

    The tiny digits MLP trains several times faster on one thread than on two
    (thread hand-off costs more than the matmuls), so training runs on one.
    In the timed runs trakcli uses its config's ``num_threads`` and traker
    torch's default (``--traker-threads`` to change).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def log(msg: str) -> None:
    """Progress text goes to stderr; the table and JSON are the output."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def rel(p: Path) -> str:
    """A path relative to the repo when it is inside it (no machine paths in the JSON)."""
    try:
        return str(Path(p).resolve().relative_to(REPO))
    except ValueError:
        return str(p)


# ----------------------------------------------------------------------------
# the trakcli side
# ----------------------------------------------------------------------------


def load_cfg(config: Path, overrides: list[str]):
    from trakcli.config import load_config

    return load_config(str(config), overrides)


# The keys of the config's `optimize` section that decide how a model trains; the
# others (n_models, out_dir, metrics, checkpoint_every, ...) do not change the model.
RECIPE_KEYS = ("epochs", "batch_size", "optimizer", "lr", "momentum", "weight_decay", "seed", "projection",
               "init_checkpoint", "subset_fraction", "entrypoint", "kwargs")


def recipe_of(cfg) -> dict[str, Any]:
    """The training recipe of the config's ``optimize`` section, as plain JSON data."""
    opt = cfg.optimize
    if opt is None:
        raise SystemExit("the config has no `optimize` section: the benchmark needs its training recipe")
    d = opt.model_dump(mode="json") if hasattr(opt, "model_dump") else dict(vars(opt))
    recipe = {k: d[k] for k in RECIPE_KEYS if k in d}
    if recipe.get("subset_fraction", 1) != 1:
        raise SystemExit("optimize.subset_fraction < 1: the benchmark's checkpoints must see the whole training set")
    return recipe


def model_spec(cfg) -> list[Any]:
    """[entrypoint, kwargs] (a list, so it round-trips through JSON)."""
    return [cfg.model.entrypoint, dict(cfg.model.kwargs or {})]


def build(cfg) -> torch.nn.Module:
    from trakcli.models import build_model

    entrypoint, kwargs = model_spec(cfg)
    return build_model(entrypoint, **kwargs)


def checkpoints(cfg, config: Path, work: Path, base_overrides: list[str]) -> list[Path]:
    """The config's N checkpoints, trained by ``trakcli.jobs.optimize`` into work/ckpts.

    Reused when work/ckpts/recipe.json matches the config's recipe and model.
    """
    from trakcli.jobs.optimize import optimize

    ckpt_dir = work / "ckpts"
    n_models = cfg.optimize.n_models
    fingerprint = {"recipe": recipe_of(cfg), "model": model_spec(cfg), "n_models": n_models}
    marker = ckpt_dir / "recipe.json"
    found = sorted(ckpt_dir.glob("model_*.pt"))
    if marker.exists() and json.loads(marker.read_text()) == fingerprint and len(found) == n_models:
        log(f"reusing {n_models} checkpoints in {rel(ckpt_dir)}")
        return found
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    ckpt_dir.mkdir(parents=True)
    log(f"training {n_models} checkpoints with trakcli.jobs.optimize into {rel(ckpt_dir)}")
    t0 = time.perf_counter()
    ocfg = load_cfg(config, base_overrides + [f"optimize.out_dir={ckpt_dir}", "num_threads=1"])
    with torch_threads(1):  # optimize() sets num_threads=1 globally; restored on exit
        paths = [Path(p) for p in optimize(ocfg)]
    log(f"  {len(paths)} checkpoints in {time.perf_counter() - t0:.1f}s")
    marker.write_text(json.dumps(fingerprint, indent=1))
    return sorted(paths)


def recipe_matches_checkpoint(cfg, data: tuple[torch.Tensor, ...], ckpt: Path) -> float:
    """Retrain checkpoint 0 with ``trakcli.train.train_one`` and compare: max |weight difference|.

    0 shows the subset models of ``trakcli.evaluation.retrain`` (trained by the same function) are
    trained exactly as ``trak optimize`` trains the checkpoints, only on fewer rows.
    """
    from trakcli.train import train_one

    with torch_threads(1):
        model = train_one(cfg, data[0], data[1], seed=int(cfg.optimize.seed)).model
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    mine = model.state_dict()
    if saved.keys() != mine.keys():
        return float("inf")
    return max(float((saved[k].float() - mine[k].float()).abs().max()) for k in saved)


def run_trakcli(config: Path, overrides: list[str], store: Path) -> tuple[np.ndarray, dict[str, float], Any]:
    """featurize + score in process, on a fresh store.

    Returns:
        (scores [n_target, n_train] float32, {"featurize": s, "score": s}, the ScoreResult).
    """
    from trakcli.jobs import featurize, score

    shutil.rmtree(store, ignore_errors=True)
    cfg = load_cfg(config, overrides)
    t0 = time.perf_counter()
    featurize(cfg, overwrite=True)
    t1 = time.perf_counter()
    result = score(cfg)
    t2 = time.perf_counter()
    scores = getattr(result, "scores", result)  # ScoreResult.scores
    return np.asarray(scores, dtype=np.float32), {"featurize": t1 - t0, "score": t2 - t1}, result


# ----------------------------------------------------------------------------
# the traker side (baseline)
# ----------------------------------------------------------------------------


def traker_featurize(traker: Any, states: list[dict[str, torch.Tensor]], rows: tuple[torch.Tensor, ...],
                     batch_size: int) -> None:
    """traker's featurize loop as its users write it: per checkpoint ``load_checkpoint``, then the train
    rows in batches of ``batch_size`` (each batch a tuple of the ``rows`` tensors ``[n, ...]``, sliced
    alike), then ``finalize_features`` (traker's kernel inverse)."""
    n = len(rows[0])
    for model_id, state in enumerate(states):
        traker.load_checkpoint(state, model_id=model_id)
        for i in range(0, n, batch_size):
            batch = tuple(t[i : i + batch_size] for t in rows)
            traker.featurize(batch=batch, num_samples=len(batch[0]))
    traker.finalize_features()


def run_traker(
    cfg,
    ckpt_paths: list[Path],
    data: tuple[torch.Tensor, ...],
    proj_dim: int,
    proj_seed: int,
    batch_size: int,
    save_dir: Path,
    block_size: int = 100,
) -> tuple[np.ndarray, dict[str, float]]:
    """MadryLab's TRAKer on the CPU.

    Returns:
        (scores [n_target, n_train] float32, {"featurize": s, "score": s}); featurize
        includes building the TRAKer and finalize_features (traker's kernel inverse).


    CPU notes: TRAKer defaults to the CudaProjector, so a BasicProjector is passed
    explicitly (rademacher, float32, cpu, ``block_size`` columns of the matrix
    regenerated per block and batch; traker's default is 100); float16
    (``use_half_precision``, traker's default) is turned off, as CPU matmuls in
    float16 are slow and lossy; ``lambda_reg`` keeps traker's default of 0.
    """
    from trak import TRAKer
    from trak.projectors import BasicProjector, ProjectionType

    x_train, y_train, x_target, y_target = data
    shutil.rmtree(save_dir, ignore_errors=True)
    states = [torch.load(p, map_location="cpu", weights_only=True) for p in ckpt_paths]

    t0 = time.perf_counter()
    model = build(cfg).eval()
    grad_dim = sum(p.numel() for p in model.parameters())
    projector = BasicProjector(
        grad_dim=grad_dim,
        proj_dim=proj_dim,
        seed=proj_seed,
        proj_type=ProjectionType.rademacher,
        device="cpu",
        dtype=torch.float32,
        block_size=block_size,
    )
    traker = TRAKer(
        model=model,
        task="image_classification",
        train_set_size=len(y_train),
        save_dir=str(save_dir),
        # load_from_save_dir=False leaves experiments.json uncreated and scoring then
        # fails (traker 0.3.2); the save_dir is emptied above, so there is nothing to load.
        load_from_save_dir=True,
        device="cpu",
        projector=projector,
        proj_dim=proj_dim,
        use_half_precision=False,
        logging_level=logging.WARNING,
    )
    traker_featurize(traker, states, (x_train, y_train), batch_size)
    t1 = time.perf_counter()
    for model_id, state in enumerate(states):
        traker.start_scoring_checkpoint(
            exp_name="digits", checkpoint=state, model_id=model_id, num_targets=len(y_target)
        )
        for i in range(0, len(y_target), batch_size):
            batch = (x_target[i : i + batch_size], y_target[i : i + batch_size])
            traker.score(batch=batch, num_samples=len(batch[1]))
    scores = traker.finalize_scores(exp_name="digits")  # [n_train, n_target]
    t2 = time.perf_counter()
    return np.ascontiguousarray(np.asarray(scores, dtype=np.float32).T), {"featurize": t1 - t0, "score": t2 - t1}


# ----------------------------------------------------------------------------
# LDS: trakcli.evaluation.retrain + trakcli.evaluation.lds (the code of `trak eval lds`)
# ----------------------------------------------------------------------------


def retrain_subsets(
    config: Path, n_subsets: int, subset_seed: int, eval_store: Path, workers: int, overrides: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """Masks [n_subsets, n_train] bool and target margins [n_subsets, n_target] float64.

    ``trakcli.evaluation.retrain.retrain`` with the config's recipe, ``eval.n_subsets=n_subsets``,
    ``eval.seed=subset_seed`` and the default ``eval.subset_fraction`` (0.5); the
    models are kept in the ``eval/`` group of ``eval_store`` (resumable, extended
    when more are asked for).
    """
    from trakcli.evaluation.retrain import retrain

    cfg = load_cfg(config, [*overrides, f"eval.n_subsets={n_subsets}", f"eval.seed={subset_seed}", f"store.path={eval_store}"])
    t0 = time.perf_counter()
    with torch_threads(torch.get_num_threads()):  # retrain() applies cfg.num_threads; restored after
        res = retrain(cfg, workers=workers)
    if res.trained:
        log(f"retrained {res.trained} subset models in {time.perf_counter() - t0:.0f}s "
            f"({workers} worker{'s' if workers > 1 else ''}) into {rel(eval_store)}/eval")
    else:
        log(f"reusing {n_subsets} retrained subset models from {rel(eval_store)}/eval")
    return res.masks, res.outputs


def lds(scores: np.ndarray, masks: np.ndarray, margins: np.ndarray, n_bootstrap: int = 1000) -> dict[str, Any]:
    """``trakcli.evaluation.lds.lds`` (the LDS of ``trak eval lds``), with the standard error of the mean added.

    Args:
        scores: [n_target, n_train] attribution scores.
        masks: [n_subsets, n_train] bool, the training rows of each retrained model.
        margins: [n_subsets, n_target] margins of the targets under each retrained model.
    """
    from trakcli.evaluation.lds import lds as trak_lds

    res = trak_lds(scores, masks, margins, n_bootstrap=n_bootstrap, seed=0)
    finite = res.rhos[np.isfinite(res.rhos)]
    return {
        "lds": res.lds,
        "lds_sem": float(finite.std(ddof=1) / np.sqrt(finite.size)) if finite.size > 1 else float("nan"),
        "lds_ci95": [res.ci_low, res.ci_high],
        "n_targets_nan": res.n_targets_nan,
    }


# ----------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------


def print_table(rows: list[dict[str, Any]]) -> None:
    """One row per model, proj_dim and method; the ratio column is traker seconds / trakcli seconds (as users run them)."""
    head = ("model", "proj_dim", "method", "user s", "featurize / score s", "in-process s", "LDS ± sem", "traker/trakcli")
    lines = []
    for r in rows:
        fs = f"{r['featurize_seconds']:.2f} / {r['score_seconds']:.2f}"
        inproc = f"{r['in_process_seconds']:.2f}" if r.get("in_process_seconds") is not None else ""
        ratio = r.get("ratio_traker_over_trakcli")
        ratio_s = f"{ratio:.2f}x" if ratio is not None else ""
        if r.get("ratio_in_process") is not None:
            ratio_s += f" (in-process {r['ratio_in_process']:.2f}x)"
        lines.append((r["model"], str(r["proj_dim"]), r["method"], f"{r['seconds']:.2f}", fs, inproc,
                      f"{r['lds']:.4f} ± {r['lds_sem']:.4f}", ratio_s))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain fallback
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
        for line in (head, *lines):
            print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
        return
    table = Table(title="TRAK on digits, CPU: trakcli as its two commands vs traker in one process")
    for i, h in enumerate(head):
        table.add_column(h, justify="left" if i in (0, 2) else "right")
    for line in lines:
        table.add_row(*line)
    Console(width=max(140, shutil.get_terminal_size().columns)).print(table)


def versions() -> dict[str, str]:
    out = {}
    for pkg in ("traker", "numpy", "scipy", "zarr"):  # trakcli's and torch's: write_result records them
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


#: The children's environment: Python's default bytecode caching, as a user's shell has it. (A
#: PYTHONDONTWRITEBYTECODE=1 in the benchmark's own environment, as in some sandboxes, would make
#: every CLI run recompile trakcli's modules, ~0.1-0.2 s that no user pays.)
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def wall(cmd: list[str]) -> float:
    """Wall seconds of one subprocess, run from the repo root; its output is captured (shown on failure)."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=CHILD_ENV)
    t = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd[:3])} ...` exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return t


def startup_seconds(repeats: int) -> list[float]:
    """Wall seconds of ``python -c "import torch"``: interpreter + torch start-up, which every CLI run pays."""
    return [wall([sys.executable, "-c", "import torch"]) for _ in range(repeats)]


def run_cli(config: Path, overrides: list[str], store: Path) -> tuple[np.ndarray, dict[str, float]]:
    """``trak featurize CONFIG ...`` then ``trak score CONFIG ...`` as two processes, on a fresh store.

    Returns:
        (scores [n_target, n_train] float32 read back from the store, {"featurize": s, "score": s}
        wall seconds of each process, start-up included).
    """
    from trakcli.store import Store

    shutil.rmtree(store, ignore_errors=True)
    trak = trak_command(" (./benchmarks/env.sh does)")
    t_feat = wall(trak + ["featurize", str(config), *overrides])
    t_score = wall(trak + ["score", str(config), *overrides])
    cfg = load_cfg(config, overrides)
    scores = Store.open_existing(store, mode="r").read(f"scores/{cfg.score.experiment}/scores")
    return np.asarray(scores, dtype=np.float32), {"featurize": t_feat, "score": t_score}


def model_overrides(name: str, n_ckpt: int | None) -> list[str]:
    """Config overrides of a benchmark model: the config's own (small) or LARGE_MLP."""
    out = []
    if name == "large":
        out.append("model.kwargs=" + json.dumps(LARGE_MLP))
    if n_ckpt is not None:  # train only the checkpoints that are used
        out.append(f"optimize.n_models={n_ckpt}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 20 subset models and 3 checkpoints (unless --n-subsets / --n-checkpoints)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON results (default: bench_results/lds_digits.json, --quick: lds_digits_quick.json)")
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="trakcli config with an optimize section")
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK, help="checkpoints, stores, retraining cache")
    ap.add_argument("--models", nargs="+", default=["small", "large"], choices=["small", "large"],
                    help=f"small: the config's model; large: mlp {LARGE_MLP}")
    ap.add_argument("--n-subsets", type=int, default=None, help="retrained models for LDS (default 100, --quick 20)")
    ap.add_argument("--n-checkpoints", type=int, default=None,
                    help="checkpoints of the small model (default: optimize.n_models, --quick 3)")
    ap.add_argument("--large-n-checkpoints", type=int, default=LARGE_N_CHECKPOINTS,
                    help="checkpoints of the large model (traker's time grows with grad_dim x proj_dim per batch)")
    ap.add_argument("--subset-seed", type=int, default=0, help="seed of the random halves and their models (eval.seed)")
    ap.add_argument("--workers", type=int, default=1, help="processes that retrain the subset models")
    ap.add_argument("--proj-dims", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--kinds", nargs="+", default=["config", "kronecker"],
                    choices=["config", "rademacher", "normal", "sjlt", "kronecker"],
                    help="trakcli projector kinds, one row each ('config': the config's own kind, proj_dim overridden)")
    ap.add_argument("--skip-traker", action="store_true", help="time and score trakcli only")
    ap.add_argument("--no-in-process", action="store_true",
                    help="skip the second trakcli timing (featurize + score called in this process)")
    ap.add_argument("--startup-repeats", type=int, default=5,
                    help="`python -c 'import torch'` runs before and after the timed runs, plus one before each "
                    "trakcli command pair (the median of all is subtracted twice)")
    ap.add_argument("--traker-block-size", type=int, default=100,
                    help="traker BasicProjector block_size (default: traker's own, 100)")
    ap.add_argument("--traker-threads", type=int, default=None,
                    help="torch threads of the traker run (default: torch's, one per core, as its users run it; "
                    "on a busy 2-core machine 1 can be several times faster)")
    ap.add_argument("--check", action="store_true", help="exit 1 if an acceptance check fails")
    args = ap.parse_args(argv)

    n_subsets = args.n_subsets or (20 if args.quick else 100)
    if n_subsets < 100 and not args.quick:
        log(f"warning: {n_subsets} subset models; LDS needs at least 100 for a stable estimate")
    work_root = args.work_dir.resolve()
    config = args.config.resolve()
    t_start = time.perf_counter()
    load_start = list(os.getloadavg())

    from trakcli.data import load_digits_split

    import trakcli.jobs  # noqa: F401  (the in-process column: imported before timing)

    if not args.skip_traker:
        import trak  # noqa: F401

    # traker takes per-example gradients with torch.func, whose first grad call imports torch._dynamo
    # (seconds). Paid here, outside traker's timer: this favours the baseline (its users pay it once per
    # process), never slows it.
    from torch.func import grad, vmap

    vmap(grad(lambda w, x: (w * x).sum()), in_dims=(None, 0))(torch.ones(3), torch.ones(2, 3))

    wall([sys.executable, "-m", "compileall", "-q", str(REPO / "trakcli")])  # .pyc files, as an installed package has
    wall(trak_command(" (./benchmarks/env.sh does)") + ["--help"])  # warm the file cache for the CLI as for the start-up runs below
    startup = startup_seconds(args.startup_repeats)
    log(f"python -c 'import torch': {', '.join(f'{t:.2f}' for t in startup)} s")
    data = load_digits_split()
    n_train, n_target = len(data[1]), len(data[3])
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []  # raw CLI walls; start-up subtracted at the end
    models_info: dict[str, Any] = {}

    for model_name in args.models:
        n_req = args.n_checkpoints or (3 if args.quick else None) if model_name == "small" else args.large_n_checkpoints
        mov = model_overrides(model_name, n_req)
        work = work_root / model_name
        work.mkdir(parents=True, exist_ok=True)
        base = load_cfg(config, mov)
        ckpt_paths = checkpoints(base, config, work, mov)
        ckpt_list = json.dumps([str(p) for p in ckpt_paths])  # a YAML flow list for the override
        batch_size = TRAKER_BATCH_SIZE
        proj_seed = int(getattr(base.projector, "seed", 0))
        n_params = sum(p.numel() for p in build(base).parameters())
        log(f"{model_name}: mlp {model_spec(base)[1]} ({n_params} parameters), {len(ckpt_paths)} checkpoints, "
            f"n_train={n_train} n_target={n_target}")
        recipe_diff = recipe_matches_checkpoint(base, data, ckpt_paths[0])
        if recipe_diff > 1e-3:
            log("warning: the LDS recipe does not reproduce `trak optimize`'s checkpoints")
        masks, margins = retrain_subsets(config, n_subsets, args.subset_seed, work / "lds_eval.zarr", args.workers, mov)
        models_info[model_name] = {
            "kwargs": model_spec(base)[1], "n_params": n_params, "n_checkpoints": len(ckpt_paths),
            "config_projector_kind": base.projector.kind, "num_threads": base.num_threads,
            "recipe_max_weight_diff_vs_checkpoint_0": recipe_diff, "n_subsets": int(len(masks)),
        }
        for proj_dim in args.proj_dims:
            for kind in args.kinds:
                kind_name = base.projector.kind if kind == "config" else kind
                label = f"trakcli {kind_name}" + (" (config)" if kind == "config" else "")
                store = work / f"trakcli_{kind_name}_{proj_dim}.zarr"
                # trakcli at its config's batch size (data.batch_size), as its users run it
                ov = [*mov, f"projector.proj_dim={proj_dim}", f"store.path={store}", f"checkpoints={ckpt_list}"]
                if kind != "config":
                    ov.append(f"projector.kind={kind}")
                log(f"{model_name} proj_dim={proj_dim}: {label}: trak featurize + trak score (two processes)")
                startup += startup_seconds(1)  # sampled between the timed runs: the load changes during the run
                load = os.getloadavg()[0]
                scores, t = run_cli(config, ov, store)
                log(f"  featurize {t['featurize']:.2f}s, score {t['score']:.2f}s (walls, start-up included)")
                row: dict[str, Any] = {"model": model_name, "proj_dim": proj_dim, "method": label, "kind": kind_name,
                                       "featurize_seconds": t["featurize"], "score_seconds": t["score"],
                                       "loadavg_1min_before": load}
                if not args.no_in_process:
                    with torch_threads(torch.get_num_threads()):  # featurize applies cfg.num_threads; restored
                        inproc = work / "inproc.zarr"
                        ov2 = [f"store.path={inproc}" if o.startswith("store.path=") else o for o in ov]
                        s2, t2, _ = run_trakcli(config, ov2, inproc)
                    row["in_process_seconds"] = t2["featurize"] + t2["score"]
                    row["in_process_max_abs_diff_vs_cli"] = float(np.abs(s2 - scores).max())
                    log(f"  in process: {row['in_process_seconds']:.2f}s")
                if not np.isfinite(scores).all():
                    raise SystemExit(f"{label}: scores hold nan/inf")
                row.update(lds(scores, masks, margins))
                log(f"  LDS {row['lds']:.4f}")
                rows.append(row)
                runs.append(row)
            if args.skip_traker:
                continue
            log(f"{model_name} proj_dim={proj_dim}: traker in one process (batch {batch_size})")
            load = os.getloadavg()[0]
            traker_threads = args.traker_threads or torch.get_num_threads()
            with torch_threads(traker_threads):
                scores, t = run_traker(base, ckpt_paths, data, proj_dim, proj_seed, batch_size,
                                       work / f"traker_{proj_dim}", block_size=args.traker_block_size)
            if not np.isfinite(scores).all():
                log("  traker scores hold nan/inf: set to 0 for the LDS")
                scores = np.nan_to_num(scores, nan=0.0, posinf=0.0, neginf=0.0)
            row = {"model": model_name, "proj_dim": proj_dim, "method": "traker", "kind": "rademacher (BasicProjector)",
                   "seconds": t["featurize"] + t["score"], "featurize_seconds": t["featurize"],
                   "score_seconds": t["score"], "loadavg_1min_before": load, "torch_threads": traker_threads,
                   **lds(scores, masks, margins)}
            log(f"  {row['seconds']:.2f}s, LDS {row['lds']:.4f}")
            rows.append(row)

    startup += startup_seconds(args.startup_repeats)
    s0 = float(np.median(startup))
    log(f"start-up median {s0:.2f}s (of {len(startup)} runs), subtracted twice from each trakcli command pair")
    traker_s = {(r["model"], r["proj_dim"]): r["seconds"] for r in rows if r["method"] == "traker"}
    for r in runs:
        r["seconds"] = r["featurize_seconds"] + r["score_seconds"] - 2 * s0
        r["score_compute_seconds"] = r["score_seconds"] - s0
        tr = traker_s.get((r["model"], r["proj_dim"]))
        r["ratio_traker_over_trakcli"] = tr / r["seconds"] if tr is not None else None
        if tr is not None and r.get("in_process_seconds"):
            r["ratio_in_process"] = tr / r["in_process_seconds"]
    rows.sort(key=lambda r: (args.models.index(r["model"]), r["proj_dim"], r["method"] == "traker"))

    checks: dict[str, dict[str, Any]] = {}
    for r in runs:
        if not r["method"].endswith("(config)"):
            continue
        key = f"{r['model']}_{r['proj_dim']}"
        tr = next((x for x in rows if x["method"] == "traker" and (x["model"], x["proj_dim"]) == (r["model"], r["proj_dim"])), None)
        if tr is not None:
            checks[f"speedup_{key}_at_least_{MIN_SPEEDUP:g}x"] = {
                "traker_over_trakcli": r["ratio_traker_over_trakcli"], "pass": bool(r["ratio_traker_over_trakcli"] >= MIN_SPEEDUP)}
            checks[f"lds_{key}_trakcli_ge_traker"] = {"trakcli": r["lds"], "traker": tr["lds"], "pass": bool(r["lds"] >= tr["lds"])}
        if r["proj_dim"] == 2048:
            checks[f"score_compute_{key}_at_most_{MAX_SCORE_2048:g}s"] = {
                "seconds": r["score_compute_seconds"], "pass": bool(r["score_compute_seconds"] <= MAX_SCORE_2048)}

    print_table(rows)
    print(f"start-up (python -c 'import torch'), median of {len(startup)}: {s0:.2f}s; "
          f"load average 1/5/15 min at start {load_start[0]:.2f}/{load_start[1]:.2f}/{load_start[2]:.2f}, "
          f"at end " + "/".join(f"{v:.2f}" for v in os.getloadavg()))
    for name, c in checks.items():
        print(f"{'PASS' if c['pass'] else 'FAIL'}  {name}: " + ", ".join(
            f"{k}={v:.4g}" for k, v in c.items() if k != "pass"))

    result = {
        "benchmark": "lds_digits",
        "protocol": ("trakcli: `trak featurize CONFIG` + `trak score CONFIG` as two processes, wall time of each, "
                     "minus 2x the median wall time of `python -c 'import torch'`; traker: one process, batch 100, "
                     "timer around featurize + finalize_features + score + finalize_scores"),
        "quick": args.quick,
        "argv": sys.argv[1:] if argv is None else argv,
        "config": rel(config),
        "n_train": n_train,
        "n_target": n_target,
        "n_subsets": n_subsets,
        "subset_seed": args.subset_seed,
        "batch_size": {"traker": TRAKER_BATCH_SIZE, "trakcli": int(load_cfg(config, []).data.batch_size)},
        "models": models_info,
        "startup_seconds": startup,
        "startup_median_seconds": s0,
        "traker_settings": {
            "projector": f"BasicProjector(rademacher, float32, cpu, block_size={args.traker_block_size})",
            "use_half_precision": False,
            "lambda_reg": 0.0,
            "torch_threads": args.traker_threads or torch.get_num_threads(),
        },
        "results": rows,
        "checks": checks,
        "env": {
            **versions(),
            "loadavg_1_5_15_at_start": load_start,
            "loadavg_1_5_15_at_end": list(os.getloadavg()),
        },
        "total_seconds": time.perf_counter() - t_start,
    }
    out = (args.out or (DEFAULT_OUT.with_name("lds_digits_quick.json") if args.quick else DEFAULT_OUT)).resolve()
    write_result(out, result)
    log(f"wrote {rel(out)} ({result['total_seconds']:.0f}s in all)")
    if args.check and not all(c["pass"] for c in checks.values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
