"""Counterfactual retraining for the linear datamodeling score: subsets, seeds, model outputs, the store rows.

``eval.n_subsets`` models are retrained with the config's recipe, model k on a random subset S_k of the training set
(:func:`subset_mask`); its row in the store's ``eval/`` group holds the mask and the targets' outputs under it (the
margin the scores attribute, :func:`model_outputs`). The LDS of those rows against a score matrix is
:func:`trakcli.evaluation.lds.lds` (Park et al. 2023, "TRAK", Sec. 2.2; Ilyas et al. 2022, "Datamodels").

Every row is a pure function of the config and k (the subset drawn with ``(eval.seed, k)``, model k seeded
with :func:`retrain_seed`), so any number of workers (:func:`run_models`; the calling process is the only
store writer), any kill and resume gives the same rows bit for bit (on one machine, with the same thread count).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from trakcli.config import Config
from trakcli.jobs.inputs import check_files
from trakcli.data.tensors import TensorDataset, index_inputs, inputs_to
from trakcli.data.text import TextDataset
from trakcli.errors import ArgumentError, ConfigError, StoreError
from trakcli.tasks import make_batch, resolve_task, task_identity
from trakcli.distributed import Dist
from trakcli.jobs.runtime import apply_threads, event, grad_memory_for, locked_store, resolve_device
from trakcli.train import DatasetRows, check_init_checkpoint, check_recipe, load_training_function, train_one
from trakcli.evaluation.scores import dataset
from trakcli.evaluation.workers import WorkerLost, run_in_workers
from trakcli.models.checkpoints import file_sha256
from trakcli.models.forward import forward
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.store.evalgroup import open_eval_rows
from trakcli.store.store import Store

#: Model k of eval seed s is seeded with MODEL_SEED_BASE + MODEL_SEED_STRIDE * s + k (recorded in the store),
#: far from the seeds of `trak optimize`'s checkpoints (optimize.seed + i).
MODEL_SEED_BASE = 10**6
MODEL_SEED_STRIDE = 100_003


def subset_mask(n_train: int, subset_fraction: float, seed: int, k: int) -> np.ndarray:
    """The training rows of retrained model k (``seed``: ``eval.seed``): ``[n_train]`` bool with exactly
    ``round(subset_fraction * n_train)`` (Python's round) True entries, at least 1 and at most n_train.

    Drawn without replacement by ``numpy.random.default_rng([seed, k])``, so mask k does not depend on how
    many masks are drawn, in which order, or by which process.
    """
    rng = np.random.default_rng([seed, k])
    mask = np.zeros(n_train, dtype=bool)
    mask[rng.choice(n_train, size=min(n_train, max(1, round(subset_fraction * n_train))), replace=False)] = True
    return mask


def model_seed(seed: int, k: int) -> int:
    """Seed of retrained model k (its initialization and minibatch order): ``10**6 + 100003 * seed + k``."""
    return MODEL_SEED_BASE + MODEL_SEED_STRIDE * seed + k


def retrain_seed(cfg: Config, k: int) -> int:
    """Seed of retrained model k under ``eval.retrain_seed``.

    ``other``: :func:`model_seed` ``(eval.seed, k)``, unlike any checkpoint's seed. ``same``: the seed
    `trak optimize` gave checkpoint ``k mod optimize.n_models``, ``optimize.seed + (k mod n_models)``:
    the attributed model's initialization and minibatch-order generator (the order itself differs, as
    it permutes the subset's rows), so the retrained models differ from it by their rows only.
    """
    if cfg.eval.retrain_seed != "other":
        oc = check_recipe(cfg, purpose="trak eval")
        return oc.seed + k % oc.n_models
    return model_seed(cfg.eval.seed, k)


def model_outputs(model: torch.nn.Module, data: TensorDataset, task: str, *, batch_size: int = 128,
                  device: torch.device | str = "cpu", memory_mb: int = 1024,
                  max_tokens: int | None = None) -> np.ndarray:
    """The model output function of every example of ``data`` (inputs ``[n, ...]`` or a dict of ``[n, L]`` text
    tensors; class labels ``[n]`` or per-token labels ``[n, L]``): ``[n]`` float64 margins, on the CPU.

    The task's ``f`` (:mod:`trakcli.tasks`), the function the per-example gradients differentiate, which TRAK
    attributes: classification / text_classification, ``logit_y − logsumexp_{j≠y} logit_j``; language_modeling,
    the sum of the next-token margins over the target tokens (Park et al. 2023, App. E). Computed without
    gradients (``model`` set to eval mode), in batches of at most ``batch_size`` examples, with the logits cast to
    float64. A batch holds at most ``memory_mb`` MiB of float64 logits; for per-token logits ``[n, L, vocab]`` the
    bound is on padded tokens (``memory_mb`` MiB / (vocab x 8 bytes)), so long rows later in the data are bounded
    as well as the first, and ``max_tokens`` (``data.batch_tokens``) bounds them too.
    """
    model.eval()
    task = resolve_task(task)  # a custom "file.py:fn" is imported once
    n = len(data)
    out = np.empty(n, dtype=np.float64)
    if n == 0:
        return out
    with torch.no_grad():
        _, x1, _ = next(data.batches(0, 1, 1))
        first = forward(model, inputs_to(x1, device))
        per_example = max(1, first.numel() * 8)  # bytes of one example's float64 logits (exact for fixed shapes)
        batch_size = max(1, min(batch_size, (memory_mb << 20) // per_example))
        if first.dim() == 3:  # [1, L, vocab] per-token logits: rows vary in length, bound each batch's tokens
            budget = max(1, (memory_mb << 20) // (first.shape[-1] * 8))
            max_tokens = budget if max_tokens is None else min(max_tokens, budget)
        for off, x, y in data.batches(0, n, batch_size, max_tokens=max_tokens):
            x = inputs_to(x, device)
            m, _ = task(forward(model, x).double(), make_batch(x, y.to(device)))  # [n_batch]
            out[off : off + len(y)] = m.cpu().numpy()
    return out


def _entrypoint_file_sha256(entrypoint: str | None) -> str | None:
    """sha256 of the ``.py`` file of a ``"file.py:function"`` entrypoint (None for modules and built-ins)."""
    if not entrypoint or ":" not in entrypoint or entrypoint.startswith("hf:"):
        return None
    target = entrypoint.rsplit(":", 1)[0]
    return file_sha256(target) if target.endswith(".py") and Path(target).is_file() else None


def eval_identity(cfg: Config, train_fingerprint: dict[str, Any], target_fingerprint: dict[str, Any]) -> dict[str, Any]:
    """Everything the retrained models' rows depend on (a JSON-able dict): what the store's ``eval/`` group is
    checked against, ``.py`` entrypoint files and ``init_checkpoint`` by their sha256.

    Not included, as they do not change the models: ``n_subsets`` (more rows extend the group), the projector,
    the checkpoints, ``optimize.n_models`` / ``out_dir`` / ``seed`` / ``metrics`` / ``checkpoint_every`` (but
    with ``eval.retrain_seed: same``, ``optimize.seed`` and ``n_models`` choose the seeds), ``device`` and
    ``num_threads``.
    """
    oc = check_recipe(cfg, purpose="trak eval")
    if oc.entrypoint is not None:
        recipe: dict[str, Any] = {"entrypoint": oc.entrypoint, "kwargs": oc.kwargs,
                                  "entrypoint_sha256": _entrypoint_file_sha256(oc.entrypoint)}
    else:
        dump = oc.model_dump(mode="json")
        recipe = {k: dump[k] for k in ("epochs", "batch_size", "optimizer", "lr", "momentum", "weight_decay", "projection")}
        # recorded when set, so a constant learning rate keeps the identity it has without these keys
        recipe.update({k: dump[k] for k in ("schedule", "warmup_steps", "warmup_fraction")
                       if dump[k] != type(oc).model_fields[k].default})
        if cfg.data.batch_tokens is not None and cfg.data.train.text_source is not None:  # text: read in batches
            recipe["batch_tokens"] = cfg.data.batch_tokens
    recipe["init_checkpoint_sha256"] = file_sha256(oc.init_checkpoint) if oc.init_checkpoint is not None else None
    identity = {
        "task": cfg.task,
        "output_function": task_identity(cfg.task)["output_function"],
        "model": {**cfg.model.model_dump(mode="json"), "entrypoint_sha256": _entrypoint_file_sha256(cfg.model.entrypoint)},
        "recipe": recipe,
        "train_data": train_fingerprint,
        "target_data": target_fingerprint,
        "subset_fraction": cfg.eval.subset_fraction,
        "seed": cfg.eval.seed,
        "model_seed": f"{MODEL_SEED_BASE} + {MODEL_SEED_STRIDE} * seed + k" if cfg.eval.retrain_seed == "other"
        else f"optimize.seed + k mod optimize.n_models: {oc.seed} + k mod {oc.n_models}",
    }
    if cfg.eval.retrain_seed == "replay":  # the sha256s of the recorded checkpoints
        from trakcli.jobs.unroll import replayed_checkpoints

        identity["replay_of"] = replayed_checkpoints(cfg)
    return identity


def check_eval_config(cfg: Config) -> None:
    """Everything retraining needs, checked before any model trains: a ConfigError on no training recipe, no
    ``data.target``, missing files or ``init_checkpoint``, an ``optimize.entrypoint`` that cannot be loaded."""
    oc = check_recipe(cfg, purpose="trak eval")
    if cfg.data.target is None:
        raise ConfigError("data.target: trak eval needs the targets whose outputs the retrained models give; give a "
                          "builtin split or a file (the targets of `trak score`)")
    check_files(cfg, need_checkpoints=False, need_target=True)
    check_init_checkpoint(oc)
    load_training_function(cfg)


def train_on_rows(cfg: Config, train: TensorDataset, rows: np.ndarray, seed: int, device: torch.device | str,
                  description: str, masked_tokens: dict[int, list[int]] | None = None) -> torch.nn.Module:
    """A model trained by :func:`trakcli.train.train_one` with ``seed`` on the rows ``rows`` (``[m]`` int) of
    ``train``: text read and tokenized batch by batch (the corpus is never in memory), tensors indexed on ``device``.
    ``masked_tokens`` (``{row: [positions]}``, token data) are left out of the loss (labels ``-100``)."""
    if isinstance(train, TextDataset):
        return train_one(cfg, DatasetRows(train, rows.tolist(), device, masked=masked_tokens), seed=seed,
                         device=device, description=description).model
    if masked_tokens:
        raise ConfigError("eval.qld.per_token masks training tokens: it needs token data (data.train of a language "
                          "model)")
    idx = torch.from_numpy(rows).to(device)
    x = index_inputs(inputs_to(train.inputs, device), idx)
    y = train.labels.to(device)[idx]
    return train_one(cfg, x, y, seed=seed, device=device, description=description).model


@dataclass
class RetrainResult:
    """The retrained models of a config, read from the store.

    Attributes:
        store: the store path.
        masks: ``[n_subsets, n_train]`` bool, the training rows of each retrained model.
        outputs: ``[n_subsets, n_target]`` float64, the targets' outputs under each model.
        trained: models trained by this run (the others were in the store).
        workers: processes that trained.
    """

    store: Path
    masks: np.ndarray
    outputs: np.ndarray
    trained: int = 0
    workers: int = 1

    @property
    def n_subsets(self) -> int:
        return int(self.masks.shape[0])


def retrain(cfg: Config, *, workers: int = 1, overwrite: bool = False,
            reporter: Reporter = NULL_REPORTER) -> RetrainResult:
    """Retrain ``eval.n_subsets`` models on random subsets; store masks and target outputs row by row.

    Model k: rows :func:`subset_mask` ``(n_train, eval.subset_fraction, eval.seed, k)`` of data.train, trained
    by :func:`trakcli.train.train_one` with seed :func:`retrain_seed` ``(cfg, k)`` (``eval.retrain_seed``); with
    ``eval.retrain_seed: replay``, checkpoint ``k mod optimize.n_models``'s recorded training rerun with the other
    rows weighted 0 (:func:`trakcli.jobs.unroll.reweighted_model`). Rows already done in the store's ``eval/`` group
    are kept (a killed run resumes; a larger ``eval.n_subsets`` extends the group); a row failing its checksum is
    retrained. The store is created if it does not exist yet (retraining does not need features), and locked while
    this runs.

    Args:
        cfg: the config: ``optimize`` (or ``training`` + ``optimizer``) is the
            recipe, ``eval`` the subsets, ``data.target`` the targets.
        workers: processes that train models (``1``: this process, with ``cfg.num_threads``). With more, each worker
            is a spawned process using ``cfg.num_threads`` torch threads (unset: the cores divided by ``workers``),
            and this process writes every finished row.
        overwrite: discard the stored retrained models and start over.
        reporter: progress (one step per model; the time left is measured after each worker's first
            model, which carries its start-up) and messages.

    Returns:
        :class:`RetrainResult` with the first ``eval.n_subsets`` rows.

    Raises:
        ConfigError: no recipe, no ``data.target``, missing files.
        ArgumentError: ``workers`` < 1.
        StoreMismatchError: the store's retrained models were made with another
            recipe, model, data, task, subset_fraction or eval seed (names the keys).
        StoreError: the store is in use or cannot be written; a worker process died.
        TrakError: training failed in a worker (its message, and the traceback for non-trakcli errors).
    """
    if workers < 1:
        raise ArgumentError(f"workers={workers}: give 1 or more processes")
    check_eval_config(cfg)
    reporter.phase("loading data.train and data.target …")
    train, target = dataset(cfg), dataset(cfg, "target")
    identity = eval_identity(cfg, train.fingerprint(), target.fingerprint())
    n = cfg.eval.n_subsets
    path = cfg.store.location
    with locked_store(path, Dist(), reporter):
        store = Store.open_or_create(path)
        rows = open_eval_rows(store, identity, n, len(train), len(target), compressor=cfg.store.compressor,
                              overwrite=overwrite)
        repaired = rows.verify()
        if repaired:
            reporter.info(f"retrained models {repaired} failed their checksum and are retrained")
        pending = rows.pending(n)
        n_workers = max(1, min(workers, len(pending)))
        if pending:
            t0 = time.perf_counter()
            have = n - len(pending)
            reporter.info(f"retraining {len(pending)} of {n} models on random {cfg.eval.subset_fraction:g} subsets of "
                          f"{len(train)} rows" + (f" ({have} in the store)" if have else "")
                          + (f", {n_workers} worker processes" if n_workers > 1 else ""))
            with reporter.task("retrain", len(pending)) as task:
                written = 0

                def write(k: int, outputs: np.ndarray) -> None:
                    nonlocal written
                    rows.write(k, subset_mask(len(train), cfg.eval.subset_fraction, cfg.eval.seed, k), outputs)
                    event(f"done eval {k}")
                    task.advance()
                    written += 1
                    if written == n_workers > 1:  # each worker's first model carried its start-up: not timed
                        task.warmed_up()

                try:
                    run_models(cfg, pending, n_workers, _retrain_task, write, "retraining model", "trak-eval-worker",
                               data=(train, target))
                except WorkerLost as e:
                    raise StoreError(f"a retraining worker process exited (exit code {e.exitcode}) with models "
                                     f"{e.unfinished[:10]} unfinished; the finished ones are in the store: rerun the "
                                     "same command to resume (with fewer --workers if it ran out of memory)") from None
            seconds = time.perf_counter() - t0
            reporter.info(f"retrained {len(pending)} models in {seconds:.1f}s ({seconds / len(pending):.2f}s per model)")
        masks, outputs = rows.read(n)
    return RetrainResult(path, masks, outputs, len(pending), n_workers)


def load_or_retrain(cfg: Config, *, workers: int = 1, overwrite: bool = False,
                    reporter: Reporter = NULL_REPORTER) -> tuple[np.ndarray, np.ndarray]:
    """The config's retrained models from the store, training those not there yet (:func:`retrain`, and what
    it raises): ``(masks [n_subsets, n_train] bool, outputs [n_subsets, n_target] float64)``, the arguments of
    :func:`trakcli.evaluation.lds.lds`."""
    res = retrain(cfg, workers=workers, overwrite=overwrite, reporter=reporter)
    return res.masks, res.outputs


# -- the models of `trak eval` (lds, qld), trained in this process or in spawned workers ----------


@dataclass
class WorkerState:
    """What a process trains with: the config, the train and target data, the device, and the task's ``plan``."""

    cfg: Config
    train: TensorDataset
    target: TensorDataset
    device: torch.device
    plan: Any = None


def _worker_setup(arg: tuple[Config, int | None, Any, Any]) -> WorkerState:
    """Set the torch threads, resolve the device and load the data unless given (once per process)."""
    cfg, threads, plan, data = arg
    apply_threads(threads)
    device = resolve_device(cfg.device)
    train, target = data or (dataset(cfg), dataset(cfg, "target"))
    return WorkerState(cfg, train, target, device, plan)


def run_models(cfg: Config, items: list[int], workers: int, task: Callable[[WorkerState, int], Any],
               on_result: Callable[[int, Any], None], what: str, name: str, *, plan: Any = None,
               data: tuple[Any, Any] | None = None) -> None:
    """``on_result(k, task(state, k))`` for every ``k`` of ``items``, in this process (``workers == 1``,
    ``cfg.num_threads``; ``data``: the train and target data already loaded) or in ``workers`` spawned
    processes (:func:`~trakcli.evaluation.workers.run_in_workers`; ``cfg.num_threads`` each, unset: the cores
    divided by ``workers``). ``what`` names a task in error messages, ``name`` the processes.

    Raises:
        WorkerLost: a worker process died. TrakError: a task failed in a worker.
    """
    if workers == 1:
        state = _worker_setup((cfg, cfg.num_threads, plan, data))
        for k in items:
            on_result(k, task(state, k))
        return
    threads = cfg.num_threads if cfg.num_threads is not None else max(1, (os.cpu_count() or 1) // workers)
    run_in_workers(items, workers=workers, setup=_worker_setup, setup_arg=(cfg, threads, plan, None), task=task,
                   on_result=on_result, describe=lambda k: f"{what} {k}", name=name)


def _retrain_task(state: WorkerState, k: int) -> np.ndarray:
    """Model k of :func:`retrain`, and the targets' outputs ``[n_target]`` float64 under it (:func:`model_outputs`)."""
    event(f"start eval {k} pid {os.getpid()}")  # counted by the kill-and-resume tests
    cfg, train, device = state.cfg, state.train, state.device
    mask = subset_mask(len(train), cfg.eval.subset_fraction, cfg.eval.seed, k)
    if cfg.eval.retrain_seed == "replay":  # no new training: the recorded run, the rows outside the subset weighted 0
        from trakcli.jobs.unroll import reweighted_model

        n_models = check_recipe(cfg, purpose="trak eval").n_models
        model = reweighted_model(cfg, k % n_models, mask, train, torch.device(device))
    else:
        model = train_on_rows(cfg, train, np.flatnonzero(mask), retrain_seed(cfg, k), device, f"retrain {k}")
    return model_outputs(model, state.target, cfg.task, batch_size=cfg.data.batch_size, device=device,
                         memory_mb=grad_memory_for(cfg.data.grad_memory_mb, device), max_tokens=cfg.data.batch_tokens)
