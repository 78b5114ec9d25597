"""`trak optimize` as a library function: N seeded models, their checkpoints and the manifest.

Per model, three steps: plan (:meth:`_Run.plan`: its rows, and whether an existing checkpoint is kept or the model is
trained), train (:meth:`_Run.train`: :func:`trakcli.train.train_one`, the same function that retrains the models of
`trak eval`), and write the manifest (:meth:`_Run.record`: ``out_dir/manifest.json`` rewritten atomically after every
finished model; layout: :mod:`trakcli.store.manifest`).
"""

from __future__ import annotations

import json
import shutil
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trakcli import __version__
from trakcli.config import Config, OptimizeConfig, recipe_identity
from trakcli.jobs.inputs import OPTIMIZER_STATE_DIR, check_files  # OPTIMIZER_STATE_DIR: out_dir's optimizer states
from trakcli.data.load import load_dataset
from trakcli.data.tensors import TensorDataset, index_inputs, inputs_to
from trakcli.data.text import TextDataset
from trakcli.errors import CheckpointError, ConfigError, TrainingError
from trakcli.gradients.second_moment import optimizer_state_record
from trakcli.files import save_training_file, write_text
from trakcli.jobs.runtime import apply_threads, event, resolve_device
from trakcli.models.build import build_model
from trakcli.models.checkpoints import load_checkpoint, read_state_dict
from trakcli.models.peft import is_peft_model, save_adapter, with_adapters
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.store import differing_keys
from trakcli.tasks import resolve_task
from trakcli.store.manifest import (FORMAT, FORMAT_VERSION, MANIFEST_NAME, checkpoint_file_name, checkpoint_sha256,
                                    read_manifest, write_manifest)
from trakcli.train import (DatasetRows, ReplayRecorder, TensorRows, TrainRows, check_init_checkpoint, check_recipe,
                           load_training_function, optimizer_param_names, record_dir, train_one, validate)
from trakcli.train.replay import RECORD_NAME, REPLAY_DIR


def manifest_identity(cfg: Config, train: TensorDataset) -> dict[str, Any]:
    """What the models of a run were trained with (equal identities: a rerun keeps the earlier models):
    ``{"model", "task", "train_data", "recipe"}`` without the run-only recipe keys
    (:data:`trakcli.config.RUN_ONLY_KEYS`), and ``"batch_tokens"`` when it bounds text batches."""
    out = {"model": cfg.model.model_dump(mode="json"), "task": cfg.task, "train_data": train.fingerprint(),
           "recipe": recipe_identity(cfg.recipe)}
    if isinstance(train, TextDataset) and cfg.data.batch_tokens is not None:
        out["batch_tokens"] = cfg.data.batch_tokens
    return out


def _previous_models(path: Path, identity: dict[str, Any], *, out_dir: Path, reporter: Reporter) -> dict[int, dict]:
    """The entries of the earlier run's manifest at ``path`` (may not exist), by model_id; ConfigError naming the
    differing keys when its models were trained with another :func:`manifest_identity`."""
    if not path.exists():
        return {}
    try:
        old = read_manifest(path, key="optimize.out_dir")
        old_identity = {k: old.get(k) for k in ("model", "task", "train_data")}
        if old.get("batch_tokens") is not None:
            old_identity["batch_tokens"] = old["batch_tokens"]
        old_identity["recipe"] = recipe_identity(old["recipe"]["optimize"])
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        reporter.info(f"{path}: not a readable manifest ({str(e).splitlines()[0]}); it is written anew")
        return {}
    diff = differing_keys(old_identity, identity)
    if diff:
        shown = ", ".join(d.replace("recipe.", "") for d in diff)
        raise ConfigError(f"optimize.out_dir: {str(out_dir)!r} holds models that trak optimize trained differently "
                          f"(its manifest differs in: {shown}); rerun with --overwrite to retrain them, or choose "
                          "another out_dir")
    return {m["model_id"]: m for m in old["models"]}


def _write_metrics(path: Path, summary: dict[str, Any]) -> None:
    """Write ``optimize.metrics`` atomically (ConfigError naming the path when it cannot be written)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(summary, indent=2) + "\n")
    except OSError as e:
        raise ConfigError(f"optimize.metrics: cannot write {str(path)!r}: {e}") from None


def checkpoint_name(oc: OptimizeConfig, i: int, epoch: int | None = None) -> str:
    """Model ``i``'s checkpoint at the end of ``epoch``, or final: ``model_000.pt`` / ``model_000_epoch1.pt``
    (``optimize.lora``: adapter folders ``model_000`` / ``model_000_epoch1``)."""
    return checkpoint_file_name(i, epoch=epoch, adapter=oc.lora is not None)


#: How to get past a checkpoint or optimizer state that cannot be written.
_WRITE_FIX = ("free disk space (or set optimize.out_dir elsewhere) and rerun the same command: the models already "
              "written are kept")


def _write_checkpoint(model: torch.nn.Module, path: Path, i: int) -> None:
    """Write the model's state dict (on the CPU; a PEFT model: its adapter folder) to ``path`` atomically
    (TrainingError naming the file and the fix when it cannot be written)."""
    if not is_peft_model(model):  # a retrained model gets the bytes (and sha256) of the first training
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        save_training_file(state, path, f"model {i}: cannot write its checkpoint", _WRITE_FIX)
        return
    try:
        save_adapter(model, path)
    except OSError as e:
        raise TrainingError(f"model {i}: cannot write its adapter folder {path}: {e}; {_WRITE_FIX}") from None


def _write_optimizer_state(oc: OptimizeConfig, checkpoint: Path, state_dict: dict[str, Any],
                           param_names: list[str], i: int) -> None:
    """Write an optimizer state to ``<checkpoint's folder>/optimizer_state/<checkpoint's name>`` atomically
    (TrainingError naming the file and the fix when it cannot be written)."""
    state = optimizer_state_record(oc.optimizer, oc.projection.model_dump() if oc.projection else None,
                                   param_names, state_dict)
    save_training_file(state, checkpoint.parent / OPTIMIZER_STATE_DIR / checkpoint.name,
                       f"model {i}: cannot write its optimizer state", _WRITE_FIX)


def _epoch_entries(oc: OptimizeConfig, i: int) -> list[dict[str, Any]]:
    """The manifest's ``epoch_checkpoints`` of model ``i``: epoch, file, sha256 (and optimizer state) per epoch."""
    out = []
    for epoch in range(1, oc.epochs):
        name = checkpoint_name(oc, i, epoch)
        item: dict[str, Any] = {"epoch": epoch, "checkpoint": name, "sha256": checkpoint_sha256(oc.out_dir / name)}
        if oc.save_optimizer_state:
            item["optimizer_state"] = f"{OPTIMIZER_STATE_DIR}/{name}"
        out.append(item)
    return out


def _epochs_written(oc: OptimizeConfig, entry: dict[str, Any]) -> bool:
    """Whether a kept model's manifest entry lists every epoch checkpoint ``oc`` asks for, unchanged on disk."""
    listed = entry.get("epoch_checkpoints")
    if not isinstance(listed, list) or len(listed) != oc.epochs - 1:
        return False
    for item in listed:
        at = oc.out_dir / str(item.get("checkpoint"))
        if not at.exists() or checkpoint_sha256(at) != item.get("sha256"):
            return False
        if oc.save_optimizer_state and not (oc.out_dir / str(item.get("optimizer_state"))).is_file():
            return False
    return True


def optimize(cfg: Config, *, overwrite: bool = False, reporter: Reporter = NULL_REPORTER) -> list[Path]:
    """Train ``optimize.n_models`` independently seeded models and write their checkpoints and manifest.

    Model ``i`` is built, seeded with ``optimize.seed + i`` and trained by :func:`trakcli.train.train_one` (the built-in
    recipe, or the user's ``optimize.entrypoint``; the same function that retrains the models of `trak eval`) on a
    random ``subset_fraction`` of ``data.train`` if below 1 (drawn with ``optimize.seed + i``), and written atomically
    to ``optimize.out_dir/model_{i:03d}.pt``. Existing files are kept (a rerun resumes) unless ``overwrite``; a model
    killed mid-training resumes bit-identically from its training state in ``out_dir/.resume/`` (saved every
    ``optimize.checkpoint_every`` steps and at epoch ends). With ``optimize.projection`` the optimizer runs in a random
    subspace (:class:`trakcli.optim.ProjectedOptimizer`); with ``data.validation`` the built-in recipe evaluates the
    model after every epoch; with ``optimize.epoch_checkpoints`` it also writes the model (and with
    ``save_optimizer_state`` its optimizer state) at the end of every epoch but the last (:func:`checkpoint_name`), a
    kept model whose epoch checkpoints are missing or changed being trained again.

    After every finished model, ``out_dir/manifest.json`` is written atomically (:mod:`trakcli.store.manifest`):
    the recipe, the model, and per model its checkpoint (relative path), sha256, seed, subset indices and metrics
    (final loss, train / target / validation accuracy, optimizer state floats, per-epoch history); ``complete``
    once all ``n_models`` are listed. A kept file reuses its previous entry while its sha256 matches, else its
    accuracies are measured and it is recorded with ``origin: found``. With ``optimize.metrics`` the per-model
    metrics also go to that JSON file.

    Returns:
        The checkpoint paths, in model_id order.

    Raises:
        ConfigError: no recipe, an output path that cannot be written, or an out_dir whose manifest records
            models trained another way (without ``overwrite``).
        DataError: data.train, data.target or data.validation cannot be loaded.
        OptimizerError: projection settings the model cannot use.
    """
    run = _Run.start(cfg, overwrite=overwrite, reporter=reporter)
    for i in range(run.oc.n_models):
        plan = run.plan(i)  # its rows; an existing checkpoint kept, or the model trained
        entry = plan.entry if plan.kept else run.train(plan)
        run.record(plan, entry)  # the manifest, after every finished model
    oc, manifest_path = run.oc, run.manifest_path
    if oc.metrics is not None:
        n_params = sum(p.numel() for p in build_model(cfg.model.entrypoint, **cfg.model.kwargs).parameters())
        _write_metrics(oc.metrics, {"trakcli_version": __version__, **run.manifest["recipe"],
                                    "model": run.manifest["model"], "n_params": n_params,
                                    "manifest": str(manifest_path), "models": run.rows})
        reporter.info(f"metrics -> {oc.metrics}")
    reporter.info(f"manifest -> {manifest_path}")
    return run.paths


@dataclass
class _Plan:
    """What `trak optimize` does with model ``i``: its checkpoint ``path``, the ``rows`` it trains on (all of
    data.train or its subset), its manifest ``entry`` (the whole entry of a kept model) and whether the checkpoint
    is ``kept`` (not trained)."""

    i: int
    path: Path
    rows: TrainRows
    entry: dict[str, Any]
    kept: bool


@dataclass
class _Run:
    """One `trak optimize` run: the checked config, the data on the device, the manifest being written."""

    cfg: Config
    oc: OptimizeConfig
    overwrite: bool
    reporter: Reporter
    train_data: Any
    train_xy: Any  # data.train as the metrics read it: (inputs, labels) on the device, or text data as it is
    held: Any
    val: Any
    device: torch.device
    previous: dict[int, dict]
    manifest: dict[str, Any]
    manifest_path: Path
    paths: list[Path] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def start(cls, cfg: Config, *, overwrite: bool, reporter: Reporter) -> _Run:
        """Check the config, load the data, create out_dir and read the earlier run's manifest (see :func:`optimize`)."""
        oc = check_recipe(cfg)
        if oc.out_dir is None:
            raise ConfigError("optimize.out_dir: required by trak optimize, the directory for its checkpoints and "
                              "manifest.json; set e.g. optimize.out_dir=ckpts")
        check_files(cfg, need_checkpoints=False, need_validation=True)
        load_training_function(cfg)  # a bad optimize.entrypoint fails before any model trains
        _check_entrypoint(oc)
        apply_threads(cfg.num_threads)

        def load(name: str) -> Any:
            section = getattr(cfg.data, name)
            return None if section is None else load_dataset(section, key=f"data.{name}", task=resolve_task(cfg.task))

        reporter.phase("loading data.train …")
        train = load("train")
        reporter.phase("loading data.target and data.validation …")
        heldout, valset = load("target"), load("validation")
        device = resolve_device(cfg.device)
        try:
            oc.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"optimize.out_dir: cannot create {str(oc.out_dir)!r}: {e}") from None
        check_init_checkpoint(oc)
        identity = manifest_identity(cfg, train)
        manifest_path = oc.out_dir / MANIFEST_NAME
        previous = {} if overwrite else _previous_models(manifest_path, identity, out_dir=oc.out_dir, reporter=reporter)
        # entries of the earlier run stay until their model is checked or retrained (a killed or failed run keeps them)
        n_kept = next((m for m in range(oc.n_models) if m not in previous), oc.n_models)
        manifest: dict[str, Any] = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "trakcli_version": __version__,
            "n_models": oc.n_models, "complete": False, "recipe": {"optimize": oc.model_dump(mode="json")},
            "model": identity["model"], "task": cfg.task, "train_data": identity["train_data"],
            "validation_data": valset.fingerprint() if valset is not None else None,
            **({"batch_tokens": identity["batch_tokens"]} if "batch_tokens" in identity else {}),
            "models": [previous[m] for m in range(n_kept)],
        }
        if overwrite:
            write_manifest(manifest_path, manifest)  # the old manifest no longer describes the files
        return cls(cfg=cfg, oc=oc, overwrite=overwrite, reporter=reporter, train_data=train,
                   train_xy=_on_device(train, device), held=_on_device(heldout, device), val=_on_device(valset, device),
                   device=device, previous=previous, manifest=manifest, manifest_path=manifest_path)

    def final_metrics(self, model: torch.nn.Module, history: list | None = None) -> dict[str, Any]:
        """Accuracy on all of data.train, on data.target and loss / accuracy on data.validation (classifiers);
        the validation loss, the last epoch's of ``history`` when there is one (language models)."""
        t, data = resolve_task(self.cfg.task), self.cfg.data

        def measure(rows: Any) -> tuple:
            return validate(model, rows, t, data.batch_size, data.batch_tokens, name="data")

        if not t.has_accuracy:
            if self.val is None:
                return {}
            last = history[-1].get("val_loss") if history else None
            return {"validation_loss": last if last is not None else measure(self.val)[0]}
        out: dict[str, Any] = {"train_accuracy": measure(self.train_xy)[1]}
        if self.held is not None:
            out["target_accuracy"] = measure(self.held)[1]
        if self.val is not None:
            out["validation_loss"], out["validation_accuracy"] = measure(self.val)
        return out

    def plan(self, i: int) -> _Plan:
        """Model ``i``'s rows (its subset drawn with ``optimize.seed + i``), and whether its checkpoint is kept:
        a file whose sha256 matches the earlier manifest (with its epoch checkpoints), or one found without a
        matching entry (recorded as found, its metrics measured); an unreadable one is trained again.

        Raises:
            CheckpointError: a found checkpoint does not fit the model (names the fix).
        """
        oc, reporter, train, device = self.oc, self.reporter, self.train_data, self.device
        path = oc.out_dir / checkpoint_name(oc, i)
        self.paths.append(path)
        entry: dict[str, Any] = {"model_id": i, "checkpoint": path.name, "sha256": None, "seed": oc.seed + i}
        subset = None
        if oc.subset_fraction < 1:
            gen = torch.Generator().manual_seed(oc.seed + i)
            k = max(1, round(oc.subset_fraction * len(train)))
            subset = torch.randperm(len(train), generator=gen)[:k].sort().values
            entry["subset_indices"] = subset.tolist()
        source = model_rows(train, subset, device, self.train_xy)
        kept = path.exists() and not self.overwrite
        if kept:
            sha = checkpoint_sha256(path)
            prev = self.previous.get(i)
            unreadable = None if prev is not None and prev.get("sha256") == sha else _unreadable(path)
            if unreadable is not None:
                kept = False
                reporter.info(f"model {i}: {unreadable}; it is trained again")
            elif prev is not None and prev.get("sha256") == sha and prev.get("checkpoint") == path.name:
                entry = {k: v for k, v in prev.items() if k != "epoch_checkpoints" or oc.epoch_checkpoints}
                if oc.epoch_checkpoints and not _epochs_written(oc, prev):
                    kept = False
                    reporter.info(f"model {i}: its epoch checkpoints (optimize.epoch_checkpoints) are missing or "
                                  "changed; it is trained again")
                else:
                    reporter.info(f"{path} exists, kept (use --overwrite to retrain)")
            else:
                with reporter.phase(f"model {i}: measuring the checkpoint found at {path} …"):
                    model = _load_found(self.cfg, path, i)
                    model.to(device).eval()
                    entry.update(sha256=sha, origin="found", metrics=self.final_metrics(model))
                why = "changed since the manifest was written" if prev is not None else "not in a manifest"
                epochs = " or epoch checkpoints" if oc.epoch_checkpoints else ""
                reporter.info(f"{path} exists ({why}): kept and recorded as it is, without a training history{epochs} "
                              "(use --overwrite to retrain)")
        if kept and oc.replay and not (record_dir(oc.out_dir, i) / RECORD_NAME).is_file():
            kept = False
            reporter.info(f"model {i}: it has no replay record (optimize.replay); it is trained again")
        return _Plan(i=i, path=path, rows=source, entry=entry, kept=kept)

    def train(self, plan: _Plan) -> dict[str, Any]:
        """Train the planned model (resuming from ``out_dir/.resume/``), write its checkpoint (with
        ``save_optimizer_state`` its optimizer state; with ``epoch_checkpoints`` those of every epoch but the
        last too) and report its line.

        Returns:
            Its manifest entry: the plan's, with sha256, ``origin: trained`` and metrics (and the optimizer
            state file and epoch checkpoints when the recipe writes them).
        """
        oc, i, path, reporter = self.oc, plan.i, plan.path, self.reporter
        resume = oc.out_dir / ".resume" / f"model_{i:03d}.pt"
        if self.overwrite:
            resume.unlink(missing_ok=True)
        elif resume.exists():
            reporter.info(f"model {i}: resuming from {resume}")
        replay = None
        if oc.replay:
            folder = record_dir(oc.out_dir, i)
            if not resume.exists():  # a fresh training: an older record is not this run's
                shutil.rmtree(folder, ignore_errors=True)
            replay = ReplayRecorder(folder, oc.replay_every)

        def save_epoch(epoch: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
            if epoch >= oc.epochs:  # the last epoch's model is the final checkpoint
                return
            at = path.parent / checkpoint_name(oc, i, epoch)
            _write_checkpoint(model, at, i)
            if oc.save_optimizer_state:
                _write_optimizer_state(oc, at, opt.state_dict(), optimizer_param_names(model, opt), i)

        trained = train_one(self.cfg, plan.rows, seed=oc.seed + i, device=self.device, reporter=reporter,
                            description=f"train model {i}", resume_path=resume, validation=self.val, name=f"model {i}",
                            epoch_end=save_epoch if oc.epoch_checkpoints else None, replay=replay)
        with suppress(OSError):
            resume.parent.rmdir()  # only when empty: no other model's state is pending
        model, metrics = trained.model, dict(trained.metrics)
        _write_checkpoint(model, path, i)
        keep = trained.optimizer_state  # None: a training function keeps its optimizer to itself
        if oc.save_optimizer_state and keep:
            _write_optimizer_state(oc, path, keep["state_dict"], keep["param_names"], i)
        history = metrics.pop("history", None)
        with reporter.phase(f"model {i}: measuring it on the data …"):
            metrics.update(self.final_metrics(model, history))
        if history is not None:
            metrics["history"] = history
        entry = dict(plan.entry)
        entry.update(sha256=checkpoint_sha256(path), origin="trained", metrics=metrics)
        if oc.save_optimizer_state and keep:
            entry["optimizer_state"] = f"{OPTIMIZER_STATE_DIR}/{path.name}"
        if oc.epoch_checkpoints:
            entry["epoch_checkpoints"] = _epoch_entries(oc, i)
        if oc.replay:
            entry["replay"] = f"{REPLAY_DIR}/{record_dir(oc.out_dir, i).name}"
        reporter.info(_model_line(i, metrics, model) + f" -> {path}")
        return entry

    def record(self, plan: _Plan, entry: dict[str, Any]) -> None:
        """Put model ``i``'s entry in the manifest (replacing the earlier run's) and write it atomically."""
        i, manifest = plan.i, self.manifest
        manifest["models"][i:i + 1] = [entry]  # replaces the earlier run's entry, or is the next one
        manifest["complete"] = len(manifest["models"]) == self.oc.n_models
        write_manifest(self.manifest_path, manifest)
        event(f"manifest {i}")
        self.rows.append({
            "model_id": i, "seed": entry["seed"], "checkpoint": str(plan.path), "sha256": entry["sha256"],
            **({"subset_indices": entry["subset_indices"]} if "subset_indices" in entry else {}),
            **entry.get("metrics", {}), **({"kept": True} if plan.kept else {}),
        })


def _check_entrypoint(oc: OptimizeConfig) -> None:
    """Refuse what only the built-in recipe does (``epoch_checkpoints``, ``replay``) with ``optimize.entrypoint``,
    and ``optimize.replay`` with ``optimize.projection`` (its random subspaces are not replayed): ConfigError
    naming both keys and the fix."""
    if oc.epoch_checkpoints and oc.entrypoint is not None:
        raise ConfigError(f"optimize.epoch_checkpoints: the built-in recipe writes them, but optimize.entrypoint "
                          f"{oc.entrypoint!r} trains the models; remove epoch_checkpoints, or the entrypoint to use "
                          "the recipe")
    if not oc.replay:
        return
    if oc.entrypoint is not None:
        raise ConfigError(f"optimize.replay: the built-in recipe records the steps, but optimize.entrypoint "
                          f"{oc.entrypoint!r} trains the models; remove the entrypoint to train with the recipe, or "
                          "optimize.replay")
    if oc.projection is not None:
        raise ConfigError(f"optimize.replay with optimize.projection (kind {oc.projection.kind!r}): the unrolled "
                          "scoring differentiates sgd, adam and adamw steps, not the projected optimizer's; remove "
                          "optimize.projection or optimize.replay")


def model_rows(train: Any, subset: torch.Tensor | None, device: torch.device, on_device: Any = None) -> TrainRows:
    """The rows a model trains on, all of data.train or its sorted ``subset``: text read batch by batch, tensors on
    ``device`` (``on_device``: data.train's ``(inputs, labels)`` already there, :func:`_on_device`)."""
    if isinstance(train, TextDataset):
        return DatasetRows(train, subset, device)
    x, y = on_device if on_device is not None else _on_device(train, device)
    if subset is None:
        return TensorRows(x, y)
    return TensorRows(index_inputs(x, subset.to(device)), y[subset.to(device)])


def _on_device(data: Any, device: torch.device) -> Any:
    """``(inputs, labels)`` of tensor data on ``device`` (moved once); text data as it is (read in batches); None."""
    if data is None or isinstance(data, TextDataset):
        return data
    return inputs_to(data.inputs, device), data.labels.to(device)


def _unreadable(path: Path) -> str | None:
    """Why the checkpoint file at ``path`` cannot be read (truncated, not a state dict), or None if it can."""
    try:
        read_state_dict(path)
    except CheckpointError as e:
        return str(e).splitlines()[0]
    return None


def _load_found(cfg: Config, path: Path, i: int) -> torch.nn.Module:
    """The model of a readable checkpoint found in out_dir without a matching manifest entry (CheckpointError
    with the fix when it does not fit the model or holds non-finite weights)."""
    model = with_adapters(build_model(cfg.model.entrypoint, **cfg.model.kwargs), [path])
    try:
        load_checkpoint(model, path, model_id=i)
    except CheckpointError as e:
        raise CheckpointError(f"{e}. trak optimize: delete {path} to train model {i} again, or rerun with --overwrite "
                              "to retrain all") from None
    return model


def _model_line(i: int, metrics: dict[str, Any], model: torch.nn.Module) -> str:
    """The line `trak optimize` reports per trained model."""
    parts = [f"model {i}:"]
    if "final_loss" in metrics:
        parts.append(f"loss {metrics['final_loss']:.4f},")
    for name in ("train", "target", "validation"):
        key = f"{name}_accuracy"
        if key in metrics:
            parts.append(f"{name} accuracy {metrics[key]:.3f},")
    if "optimizer_state_numel" in metrics:
        n_params = sum(p.numel() for p in model.parameters())
        share = metrics["optimizer_state_numel"] / (2 * n_params)
        parts.append(f"optimizer state {metrics['optimizer_state_numel']} floats ({share:.1%} of AdamW's)")
    return " ".join(parts).rstrip(",:")
