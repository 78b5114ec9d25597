"""Counterfactual evaluation of attribution scores: the linear datamodeling score (LDS).

LDS (Park et al. 2023, "TRAK", Sec. 2.2; Ilyas et al. 2022, "Datamodels"):
``n_subsets`` models are retrained, model k on a random subset S_k of the
training set (``mask[k]``, exactly ``round(subset_fraction * n_train)`` rows),
with the config's training recipe. For each target t, the scores predict the
model output under S_k as the sum of the scores of the rows in S_k,
``pred[k, t] = mask[k] @ scores[t]``; the LDS of target t is the Spearman rank
correlation over k between ``pred[:, t]`` and the actual output ``outputs[k, t]``
(the margin of design.md "Math", the function the scores attribute), and the
LDS is its mean over targets.

Retraining (:func:`retrain`, :func:`load_or_retrain`) writes one row per model
to the store's ``eval/`` group (:meth:`trakcli.store.Store.eval_rows`): a row
is written, then its done flag, so a killed run resumes at the models not done.
With ``workers > 1`` the models are trained by worker processes (spawn), and
the calling process is the only store writer. Every row is a pure function of
the config and k: the subset is drawn with ``(eval.seed, k)`` and model k is
seeded with :func:`model_seed`, so any number of workers, any kill and resume
gives the same rows bit for bit (on one machine, with the same thread count).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trakcli.config import Config, check_files, recipe_key
from trakcli.data import TensorDataset, index_inputs, inputs_to, load_dataset
from trakcli.errors import ConfigError, DataError, StoreError, StoreMismatchError, TrakError, UsageError
from trakcli.progress import NULL_REPORTER, Reporter

#: Model k of eval seed s is seeded with MODEL_SEED_BASE + MODEL_SEED_STRIDE * s + k (recorded in the store),
#: far from the seeds of `trak optimize`'s checkpoints (optimize.seed + i).
MODEL_SEED_BASE = 10**6
MODEL_SEED_STRIDE = 100_003

#: Quantiles of the per-target LDS that :class:`LDSResult` reports.
QUANTILES = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)


# ----------------------------------------------------------------------------
# subsets and seeds


def subset_size(n_train: int, subset_fraction: float) -> int:
    """Rows per subset: ``round(subset_fraction * n_train)`` (Python's round), at least 1 and at most n_train."""
    return min(n_train, max(1, round(subset_fraction * n_train)))


def subset_mask(n_train: int, subset_fraction: float, seed: int, k: int) -> np.ndarray:
    """The training rows of retrained model k: a pure function of ``(seed, k)``.

    Drawn without replacement by ``numpy.random.default_rng([seed, k])``, so
    mask k does not depend on how many masks are drawn, in which order, or by
    which process.

    Args:
        n_train: training set size.
        subset_fraction: share of the rows in the subset (``eval.subset_fraction``).
        seed: ``eval.seed``.
        k: index of the retrained model.

    Returns:
        ``[n_train]`` bool with exactly :func:`subset_size` True entries.
    """
    rng = np.random.default_rng([seed, k])
    mask = np.zeros(n_train, dtype=bool)
    mask[rng.choice(n_train, size=subset_size(n_train, subset_fraction), replace=False)] = True
    return mask


def subset_masks(n_train: int, subset_fraction: float, seed: int, n_subsets: int) -> np.ndarray:
    """Masks ``[n_subsets, n_train]`` bool, row k = :func:`subset_mask` ``(..., k)``."""
    return np.stack([subset_mask(n_train, subset_fraction, seed, k) for k in range(n_subsets)])


def model_seed(seed: int, k: int) -> int:
    """Seed of retrained model k (its initialization and minibatch order): ``10**6 + 100003 * seed + k``."""
    return MODEL_SEED_BASE + MODEL_SEED_STRIDE * seed + k


# ----------------------------------------------------------------------------
# model outputs


def model_outputs(
    model: torch.nn.Module,
    data: TensorDataset,
    task: str,
    *,
    batch_size: int = 128,
    device: torch.device | str = "cpu",
    memory_mb: int = 1024,
) -> np.ndarray:
    """The model output function of every example: the margin that TRAK attributes.

    The same functions as the per-example gradients (:mod:`trakcli.gradients`):
    classification / text_classification, ``logit_y − logsumexp_{j≠y} logit_j``;
    language_modeling, the sum of the next-token margins over the text
    (design.md "Math"). Computed without gradients, in batches, with the
    logits cast to float64.

    Args:
        model: the trained model (set to eval mode).
        data: the examples (inputs ``[n, ...]`` or a dict of ``[n, L]`` text tensors, labels ``[n]``).
        task: ``cfg.task``.
        batch_size: most examples per forward pass.
        device: the model's device.
        memory_mb: most MiB of float64 logits per batch (a language model's
            ``[n, L, vocab]`` logits are large): batches are cut to fit.

    Returns:
        ``[n]`` float64 margins, on the CPU.
    """
    from trakcli.gradients import classification_margin, language_modeling_margin
    from trakcli.hf import forward

    model.eval()
    n = len(data)
    out = np.empty(n, dtype=np.float64)
    if n == 0:
        return out
    with torch.no_grad():
        first = forward(model, inputs_to(index_inputs(data.inputs, torch.arange(1)), device))
        per_example = max(1, first.numel() * 8)  # bytes of one example's float64 logits
        batch_size = max(1, min(batch_size, (memory_mb << 20) // per_example))
        for off, x, y in data.batches(0, n, batch_size):
            x = inputs_to(x, device)
            logits = forward(model, x).double()
            if task == "language_modeling":
                m = torch.vmap(language_modeling_margin)(logits, x["input_ids"], x["attention_mask"])[0]
            else:
                m = torch.vmap(classification_margin)(logits.reshape(len(y), -1), y.to(device))[0]
            out[off : off + len(y)] = m.cpu().numpy()
    return out


# ----------------------------------------------------------------------------
# what the retrained models depend on


def _entrypoint_file_sha256(entrypoint: str | None) -> str | None:
    """sha256 of the ``.py`` file of a ``"file.py:function"`` entrypoint (None for modules and built-ins)."""
    from trakcli.models import file_sha256

    if not entrypoint or ":" not in entrypoint or entrypoint.startswith("hf:"):
        return None
    target = entrypoint.rsplit(":", 1)[0]
    return file_sha256(target) if target.endswith(".py") and Path(target).is_file() else None


def eval_identity(cfg: Config, train_fingerprint: dict[str, Any], target_fingerprint: dict[str, Any]) -> dict[str, Any]:
    """Everything the retrained models' rows depend on: what the store's ``eval/`` group is checked against.

    Not included, as they do not change the models: ``n_subsets`` (more rows
    extend the group), the projector, the checkpoints, ``optimize.n_models`` /
    ``out_dir`` / ``seed`` / ``metrics`` / ``checkpoint_every``, ``device`` and
    ``num_threads``.

    Returns:
        A JSON-able dict: task, output function, model (entrypoint, kwargs and
        the sha256 of a ``.py`` entrypoint file), training recipe (the built-in
        recipe's hyperparameters, or ``training.entrypoint``, its kwargs and
        file sha256; the sha256 of ``init_checkpoint``), train and target data
        fingerprints, subset_fraction, eval seed and the model seed rule.
    """
    from trakcli.gradients import OUTPUT_FUNCTIONS
    from trakcli.models import file_sha256
    from trakcli.training import check_recipe

    oc = check_recipe(cfg, purpose="trak eval")
    if oc.entrypoint is not None:
        recipe: dict[str, Any] = {
            "entrypoint": oc.entrypoint,
            "kwargs": oc.kwargs,
            "entrypoint_sha256": _entrypoint_file_sha256(oc.entrypoint),
        }
    else:
        dump = oc.model_dump(mode="json")
        recipe = {k: dump[k] for k in ("epochs", "batch_size", "optimizer", "lr", "momentum", "weight_decay", "projection")}
    recipe["init_checkpoint_sha256"] = file_sha256(oc.init_checkpoint) if oc.init_checkpoint is not None else None
    return {
        "task": cfg.task,
        "output_function": OUTPUT_FUNCTIONS[cfg.task],
        "model": {**cfg.model.model_dump(mode="json"), "entrypoint_sha256": _entrypoint_file_sha256(cfg.model.entrypoint)},
        "recipe": recipe,
        "train_data": train_fingerprint,
        "target_data": target_fingerprint,
        "subset_fraction": cfg.eval.subset_fraction,
        "seed": cfg.eval.seed,
        "model_seed": f"{MODEL_SEED_BASE} + {MODEL_SEED_STRIDE} * seed + k",
    }


def _check_config(cfg: Config) -> None:
    """Everything retraining needs, checked before any model trains."""
    from trakcli.training import check_init_checkpoint, check_recipe, load_training_function

    oc = check_recipe(cfg, purpose="trak eval")
    if cfg.data.target is None:
        raise ConfigError(
            "data.target: trak eval needs the targets whose outputs the retrained models give; give a builtin split "
            "or a file (the targets of `trak score`)"
        )
    check_files(cfg, need_checkpoints=False, need_target=True)
    check_init_checkpoint(oc, recipe_key(cfg))
    load_training_function(cfg)


# ----------------------------------------------------------------------------
# retraining


def retrain_one(
    cfg: Config, k: int, train: TensorDataset, target: TensorDataset, device: torch.device | str = "cpu"
) -> np.ndarray:
    """Train model k on its subset with the config's recipe and return the targets' outputs.

    Model k: rows :func:`subset_mask` ``(n_train, eval.subset_fraction, eval.seed, k)``
    of ``train``, trained by :func:`trakcli.training.train_one` with seed
    :func:`model_seed` ``(eval.seed, k)``.

    Returns:
        ``[n_target]`` float64 model outputs of ``target`` (:func:`model_outputs`).
    """
    from trakcli.training import train_one

    mask = subset_mask(len(train), cfg.eval.subset_fraction, cfg.eval.seed, k)
    idx = torch.from_numpy(np.flatnonzero(mask)).to(device)
    x = index_inputs(inputs_to(train.inputs, device), idx)
    y = train.labels.to(device)[idx]
    model = train_one(cfg, x, y, seed=model_seed(cfg.eval.seed, k), device=device, description=f"retrain {k}")
    return model_outputs(
        model, target, cfg.task, batch_size=cfg.data.batch_size, device=device, memory_mb=cfg.data.grad_memory_mb
    )


@dataclass
class RetrainResult:
    """The retrained models of a config, read from the store.

    Attributes:
        store: the store path.
        masks: ``[n_subsets, n_train]`` bool, the training rows of each retrained model.
        outputs: ``[n_subsets, n_target]`` float64, the targets' outputs under each model.
        trained: models trained by this run (the others were in the store).
        repaired: rows whose checksum failed and that were retrained.
        workers: processes that trained.
        seconds: wall-clock time of this run's training.
    """

    store: Path
    masks: np.ndarray
    outputs: np.ndarray
    trained: int = 0
    repaired: list[int] = field(default_factory=list)
    workers: int = 1
    seconds: float = 0.0

    @property
    def n_subsets(self) -> int:
        return int(self.masks.shape[0])


def _threads_per_worker(cfg: Config, workers: int) -> int:
    """cfg.num_threads if set, else the cores shared out between the workers (at least 1)."""
    if cfg.num_threads is not None:
        return cfg.num_threads
    return max(1, (os.cpu_count() or 1) // workers)


def retrain(
    cfg: Config,
    *,
    workers: int = 1,
    overwrite: bool = False,
    reporter: Reporter = NULL_REPORTER,
) -> RetrainResult:
    """Retrain ``eval.n_subsets`` models on random subsets; store masks and target outputs row by row.

    Model k is described in :func:`retrain_one`. Rows already done in the
    store's ``eval/`` group are kept (a killed run resumes; a larger
    ``eval.n_subsets`` extends the group); a row failing its checksum is
    retrained. The store is created if it does not exist yet (retraining does
    not need features), and locked while this runs.

    Args:
        cfg: the config: ``optimize`` (or ``training`` + ``optimizer``) is the
            recipe, ``eval`` the subsets, ``data.target`` the targets.
        workers: processes that train models (``1``: this process, with
            ``cfg.num_threads``). With more, each worker is a spawned process
            using ``cfg.num_threads`` torch threads (unset: the cores divided
            by ``workers``), and this process writes every finished row.
        overwrite: discard the stored retrained models and start over.
        reporter: progress (one step per model) and messages.

    Returns:
        :class:`RetrainResult` with the first ``eval.n_subsets`` rows.

    Raises:
        ConfigError: no recipe, no ``data.target``, missing files.
        UsageError: ``workers`` < 1.
        StoreMismatchError: the store's retrained models were made with another
            recipe, model, data, task, subset_fraction or eval seed (names the keys).
        StoreError: the store is in use or cannot be written; a worker process died.
        TrakError: training failed in a worker (its message, and the traceback for non-trakcli errors).
    """
    from trakcli.pipeline import _apply_threads, _event, resolve_device
    from trakcli.store import Store, StoreLock

    if workers < 1:
        raise UsageError(f"--workers {workers}: give 1 or more processes")
    _check_config(cfg)
    train = load_dataset(cfg.data.train, key="data.train")
    target = load_dataset(cfg.data.target, key="data.target")  # type: ignore[arg-type]  # checked above
    identity = eval_identity(cfg, train.fingerprint(), target.fingerprint())
    n = cfg.eval.n_subsets
    path = Path(cfg.store.path)
    Store.prepare_parent(path)
    lock = StoreLock.for_store(path)
    note = lock.acquire()
    if note:
        reporter.info(note)
    try:
        store = Store.open_or_create(path)
        rows = store.eval_rows(
            identity, n, len(train), len(target), compressor=cfg.store.compressor, overwrite=overwrite
        )
        repaired = rows.verify()
        if repaired:
            reporter.info(f"retrained models {repaired} failed their checksum and are retrained")
        pending = rows.pending(n)
        n_workers = max(1, min(workers, len(pending)))
        t0 = time.perf_counter()
        if pending:
            have = n - len(pending)
            reporter.info(
                f"retraining {len(pending)} of {n} models on random {cfg.eval.subset_fraction:g} subsets of "
                f"{len(train)} rows" + (f" ({have} in the store)" if have else "")
                + (f", {n_workers} worker processes" if n_workers > 1 else "")
            )
            with reporter.task("retrain", len(pending)) as task:

                def write(k: int, outputs: np.ndarray) -> None:
                    rows.write(k, subset_mask(len(train), cfg.eval.subset_fraction, cfg.eval.seed, k), outputs)
                    _event(f"done eval {k}")
                    task.advance()

                if n_workers == 1:
                    _apply_threads(cfg)
                    device = resolve_device(cfg.device)
                    for k in pending:
                        _event(f"start eval {k} pid {os.getpid()}")
                        write(k, retrain_one(cfg, k, train, target, device))
                else:
                    _retrain_in_workers(cfg, pending, n_workers, write)
        seconds = time.perf_counter() - t0
        if pending:
            reporter.info(f"retrained {len(pending)} models in {seconds:.1f}s ({seconds / len(pending):.2f}s per model)")
        masks, outputs = rows.read(n)
    finally:
        lock.release()
    return RetrainResult(path, masks, outputs, len(pending), repaired, n_workers, seconds)


def load_or_retrain(
    cfg: Config, *, workers: int = 1, overwrite: bool = False, reporter: Reporter = NULL_REPORTER
) -> tuple[np.ndarray, np.ndarray]:
    """The config's retrained models from the store, training those not there yet (:func:`retrain`).

    Returns:
        ``(masks [n_subsets, n_train] bool, outputs [n_subsets, n_target] float64)``,
        ``n_subsets = eval.n_subsets``; the arguments of :func:`lds`.

    Raises:
        What :func:`retrain` raises.
    """
    res = retrain(cfg, workers=workers, overwrite=overwrite, reporter=reporter)
    return res.masks, res.outputs


# -- worker processes ---------------------------------------------------------


def _exit_with_parent() -> None:
    """In a worker: exit as soon as the parent process is gone (killed), so no orphan trains on."""
    from multiprocessing.connection import wait

    parent = mp.parent_process()
    if parent is None:
        return
    wait([parent.sentinel])
    os._exit(1)


def _worker_main(cfg: Config, threads: int, tasks: Any, results: Any) -> None:
    """A worker: train the models whose indices arrive on ``tasks``; put ``(kind, k, payload)`` on ``results``."""
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it terminates the workers
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    try:
        from trakcli.pipeline import _event, resolve_device

        torch.set_num_threads(threads)
        device = resolve_device(cfg.device)
        train = load_dataset(cfg.data.train, key="data.train")
        target = load_dataset(cfg.data.target, key="data.target")  # type: ignore[arg-type]
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put(("error", -1, _describe(e)))
        return
    while True:
        k = tasks.get()
        if k is None:
            return
        try:
            _event(f"start eval {k} pid {os.getpid()}")
            results.put(("ok", k, retrain_one(cfg, k, train, target, device)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            results.put(("error", k, _describe(e)))
            return


def _describe(e: BaseException) -> str:
    if isinstance(e, TrakError):
        return str(e)
    return f"{e.__class__.__name__}: {e}\n{traceback.format_exc().rstrip()}"


def _retrain_in_workers(cfg: Config, pending: list[int], workers: int, write: Any) -> None:
    """Train the ``pending`` models in ``workers`` spawned processes; ``write(k, outputs)`` each as it finishes.

    The workers ignore SIGINT, exit when this process dies, and are terminated
    when this function leaves (normally, on an error or on Ctrl-C).
    """
    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    for k in pending:
        tasks.put(k)
    for _ in range(workers):
        tasks.put(None)
    threads = _threads_per_worker(cfg, workers)
    procs = [
        ctx.Process(target=_worker_main, args=(cfg, threads, tasks, results), name=f"trak-eval-worker-{i}", daemon=True)
        for i in range(workers)
    ]
    remaining = set(pending)
    try:
        for p in procs:
            p.start()
        while remaining:
            try:
                kind, k, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or all(p.exitcode is not None for p in procs):
                    code = dead[0].exitcode if dead else 0
                    raise StoreError(
                        f"a retraining worker process exited (exit code {code}) with models {sorted(remaining)[:10]} "
                        "unfinished; the finished ones are in the store: rerun the same command to resume "
                        "(with fewer --workers if it ran out of memory)"
                    )
                continue
            if kind == "error":
                which = f"retraining model {k}" if k >= 0 else "starting a worker"
                raise TrakError(f"{which} failed in a worker process: {payload}")
            write(k, payload)
            remaining.discard(k)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        tasks.cancel_join_thread()
        results.cancel_join_thread()
        tasks.close()
        results.close()


# ----------------------------------------------------------------------------
# scores of the store


def store_scores(cfg: Config) -> np.ndarray:
    """The scores of experiment ``score.experiment`` in the config's store, checked complete.

    Returns:
        ``[n_target, n_train]`` float32.

    Raises:
        StoreError: no store, no scores of the experiment, or unfinished ones
            (each names the `trak featurize` / `trak score` command to run).
        StoreMismatchError: the scores were computed on other train or target
            data than the config's.
    """
    from trakcli.store import Store

    path = Path(cfg.store.path)
    exp = cfg.score.experiment
    if not (path / "zarr.json").exists():
        raise StoreError(
            f"no store at {path}, so no scores of experiment {exp!r} to evaluate; run `trak featurize CONFIG` and "
            "`trak score CONFIG` first (or give --scores FILE)"
        )
    store = Store.open_existing(path, mode="r")
    scores, attrs = store.read_scores(exp)
    train = load_dataset(cfg.data.train, key="data.train")
    problems = []
    if store.identity.get("train_data") != train.fingerprint():
        problems.append("data.train differs from the train data the store was featurized with")
    if cfg.data.target is not None:
        target = load_dataset(cfg.data.target, key="data.target")
        if attrs.get("target_data") != target.fingerprint():
            problems.append(f"data.target differs from the targets of experiment {exp!r}")
    if problems:
        raise StoreMismatchError(
            f"the scores in {path} do not belong to this config: " + "; ".join(problems)
            + "; rerun `trak featurize CONFIG --overwrite` and `trak score CONFIG --overwrite`"
        )
    return np.asarray(scores, dtype=np.float32)


# ----------------------------------------------------------------------------
# LDS


def check_lds_inputs(
    scores: Any,
    masks: Any,
    outputs: Any,
    *,
    names: dict[str, str] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate and convert the three arrays of :func:`lds`.

    Args:
        scores: ``[n_target, n_train]`` real numbers.
        masks: ``[n_subsets, n_train]`` bool (or 0/1 numbers).
        outputs: ``[n_subsets, n_target]`` real numbers.
        names: how messages call each array (e.g. the file it came from); keys
            ``scores``, ``masks``, ``outputs``.

    Returns:
        ``(scores float64, masks bool, outputs float64)``.

    Raises:
        DataError: a wrong number of dimensions, a non-numeric dtype, masks
            other than 0/1, non-finite values, fewer than 2 subsets, or shapes
            that do not fit together (names the array, its shape, the expected
            shape and where the expected sizes come from).
    """
    names = {"scores": "scores", "masks": "masks", "outputs": "outputs", **(names or {})}
    expect = {
        "scores": "[n_target, n_train]",
        "masks": "[n_subsets, n_train] bool",
        "outputs": "[n_subsets, n_target] float",
    }
    arrays = {"scores": np.asarray(scores), "masks": np.asarray(masks), "outputs": np.asarray(outputs)}
    for key, a in arrays.items():
        if a.ndim != 2:
            raise DataError(f"{names[key]} has shape {list(a.shape)}; expected a 2-D array {expect[key]}")
        if not (a.dtype == bool or np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
            raise DataError(f"{names[key]} has dtype {a.dtype}; expected {expect[key]} numbers")
    m = arrays["masks"]
    if m.dtype != bool:
        bad = ~np.isin(m, (0, 1))
        if bad.any():
            raise DataError(
                f"{names['masks']} holds values other than 0 and 1 (e.g. {m[bad].flat[0]!r}); expected {expect['masks']}: "
                "True where the retrained model's subset holds the training row"
            )
        m = m.astype(bool)
    s = arrays["scores"].astype(np.float64, copy=False)
    o = arrays["outputs"].astype(np.float64, copy=False)
    for key, a in (("scores", s), ("outputs", o)):
        bad = ~np.isfinite(a)
        if bad.any():
            rows = np.unique(np.nonzero(bad)[0])[:5].tolist()
            raise DataError(
                f"{names[key]} holds {int(bad.sum())} NaN/inf values (rows {rows}); the LDS needs finite "
                f"{expect[key]} values: drop or fix those rows"
            )
    n_subsets, n_train = m.shape
    if n_subsets < 2:
        raise DataError(f"{names['masks']} has {n_subsets} row; the LDS needs at least 2 retrained models (rows)")
    if o.shape[0] != n_subsets:
        raise DataError(
            f"{names['outputs']} has shape {list(o.shape)}, expected [{n_subsets}, n_target]: one row per retrained "
            f"model, as {names['masks']} (shape {list(m.shape)}) has {n_subsets}"
        )
    n_target = o.shape[1]
    if s.shape != (n_target, n_train):
        raise DataError(
            f"{names['scores']} has shape {list(s.shape)}, expected [{n_target}, {n_train}] = [n_target, n_train] "
            f"(n_target from {names['outputs']} {list(o.shape)}, n_train from {names['masks']} {list(m.shape)}); "
            "give scores of the same targets and training set as the retraining"
        )
    return s, m, o


def spearman_columns(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman rank correlation of each column of ``a`` with the same column of ``b``.

    Ranks along axis 0 with ties averaged (``scipy.stats.rankdata``), then the
    Pearson correlation of the ranks per column: equal to
    ``scipy.stats.spearmanr(a[:, j], b[:, j]).statistic`` for every column.

    Args:
        a, b: ``[n, m]`` real arrays.

    Returns:
        ``[m]`` float64 in [-1, 1]; NaN where a column of ``a`` or ``b`` is constant.
    """
    from scipy.stats import rankdata

    ra = rankdata(a, axis=0)
    rb = rankdata(b, axis=0)
    ra -= ra.mean(axis=0)
    rb -= rb.mean(axis=0)
    num = (ra * rb).sum(axis=0)
    den = np.sqrt((ra * ra).sum(axis=0) * (rb * rb).sum(axis=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
    return np.clip(rho, -1.0, 1.0)


@dataclass
class LDSResult:
    """The linear datamodeling score of a score matrix.

    Attributes:
        lds: mean over targets (with a defined correlation) of the per-target LDS.
        ci_low, ci_high: percentile bootstrap interval of ``lds`` over targets
            (``confidence_level``; NaN with fewer than 2 targets or no resamples).
        rhos: ``[n_target]`` float64 per-target Spearman correlations; NaN where
            the predictions or the outputs of a target are constant.
        n_targets_nan: targets whose correlation is NaN (left out of ``lds``).
        n_subsets, n_target: sizes.
        quantiles: quantile (0, 0.05, ..., 1) -> per-target LDS at it.
        histogram: ``(counts [10], edges [11])`` of the per-target LDS over [-1, 1].
        n_bootstrap, confidence_level, seed: the bootstrap settings.
    """

    lds: float
    ci_low: float
    ci_high: float
    rhos: np.ndarray
    n_targets_nan: int
    n_subsets: int
    n_target: int
    quantiles: dict[float, float]
    histogram: tuple[np.ndarray, np.ndarray]
    n_bootstrap: int
    confidence_level: float
    seed: int

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (NaN -> None)."""

        def num(x: float) -> float | None:
            return float(x) if np.isfinite(x) else None

        counts, edges = self.histogram
        return {
            "lds": num(self.lds),
            "ci_low": num(self.ci_low),
            "ci_high": num(self.ci_high),
            "confidence_level": self.confidence_level,
            "n_bootstrap": self.n_bootstrap,
            "bootstrap_seed": self.seed,
            "n_subsets": self.n_subsets,
            "n_target": self.n_target,
            "n_targets_nan": self.n_targets_nan,
            "quantiles": {f"{q:g}": num(v) for q, v in self.quantiles.items()},
            "histogram": {"counts": [int(c) for c in counts], "edges": [float(e) for e in edges]},
            "per_target": [num(r) for r in self.rhos],
        }


def lds(
    scores: Any,
    masks: Any,
    outputs: Any,
    *,
    n_bootstrap: int = 1000,
    seed: int = 0,
    confidence_level: float = 0.95,
) -> LDSResult:
    """Linear datamodeling score of ``scores`` against retrained models (Park et al. 2023, Eq. 5).

    ``pred = masks @ scores.T`` (``[n_subsets, n_target]``, float64) predicts
    each target's output under each subset; the per-target LDS is the
    Spearman correlation of ``pred[:, t]`` with ``outputs[:, t]``
    (:func:`spearman_columns`), and the LDS is its mean over the targets
    whose correlation is defined. The interval is a percentile bootstrap of
    that mean over targets (``scipy.stats.bootstrap``).

    Args:
        scores: ``[n_target, n_train]`` attribution scores (any real dtype).
        masks: ``[n_subsets, n_train]`` bool, the training rows of each retrained model.
        outputs: ``[n_subsets, n_target]`` the targets' model outputs under each retrained model.
        n_bootstrap: bootstrap resamples (0: no interval).
        seed: seed of the bootstrap resampling.
        confidence_level: of the interval.

    Returns:
        :class:`LDSResult`.

    Raises:
        DataError: inputs of wrong shapes, dtypes or with non-finite values (:func:`check_lds_inputs`).
    """
    from scipy.stats import bootstrap

    s, m, o = check_lds_inputs(scores, masks, outputs)
    pred = m.astype(np.float64) @ s.T  # [n_subsets, n_target]
    rhos = spearman_columns(pred, o)
    ok = np.isfinite(rhos)
    finite = rhos[ok]
    mean = float(finite.mean()) if finite.size else float("nan")
    lo = hi = float("nan")
    if n_bootstrap > 0 and finite.size >= 2:
        if np.ptp(finite) == 0:  # every target the same: the interval is that value
            lo = hi = mean
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ci = bootstrap(
                    (finite,), np.mean, n_resamples=n_bootstrap, confidence_level=confidence_level,
                    method="percentile", vectorized=True, rng=np.random.default_rng(seed),
                ).confidence_interval
            lo, hi = float(ci.low), float(ci.high)
    quantiles = {
        q: (float(np.quantile(finite, q)) if finite.size else float("nan")) for q in QUANTILES
    }
    hist = np.histogram(finite, bins=10, range=(-1.0, 1.0))
    return LDSResult(
        lds=mean, ci_low=lo, ci_high=hi, rhos=rhos, n_targets_nan=int((~ok).sum()),
        n_subsets=int(m.shape[0]), n_target=int(o.shape[1]), quantiles=quantiles, histogram=hist,
        n_bootstrap=n_bootstrap, confidence_level=confidence_level, seed=seed,
    )
