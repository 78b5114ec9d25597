"""The manifest of `trak optimize`: which checkpoints a run wrote, how, and how well they train.

`trak optimize` writes ``<out_dir>/manifest.json`` atomically after every finished model, so a killed run leaves a
correct manifest of the models it finished. ``checkpoints: <out_dir>/manifest.json`` in a config makes featurize and
score read the checkpoints from it (:func:`manifest_checkpoints`), refusing a manifest of an unfinished run or a
checkpoint whose bytes changed.

Layout (JSON)::

    {
      "format": "trakcli.optimize.manifest", "format_version": 1,
      "trakcli_version": "0.1.0",
      "n_models": 10,                  # the run's optimize.n_models
      "complete": true,                # every one of the n_models models is listed
      "recipe": {"optimize": {...}},   # the run's optimize: section
      "model": {"entrypoint": "mlp", "kwargs": {...}},
      "task": "classification",
      "train_data": {"n": 1437, "input_shape": [...], "input_dtype": "float32", "sha256": "..."},
      "validation_data": {...} or null,
      "models": [                      # model_id order: model_id i is models[i]
        {"model_id": 0, "checkpoint": "model_000.pt",     # relative to the manifest's directory
         "sha256": "...", "seed": 0, "subset_indices": [...],   # subset_indices only when subset_fraction < 1
         "metrics": {"final_loss": ..., "train_accuracy": ..., "target_accuracy": ...,
                     "optimizer_state_numel": ..., "history": [{"epoch": 1, "loss": ..., ...}, ...]},
         "optimizer_state": "optimizer_state/model_000.pt",   # with optimize.save_optimizer_state
         "epoch_checkpoints": [                               # with optimize.epoch_checkpoints
           {"epoch": 1, "checkpoint": "model_000_epoch1.pt", "sha256": "...",
            "optimizer_state": "optimizer_state/model_000_epoch1.pt"}, ...]},
        ...
      ]
    }

The checkpoints of a manifest (:func:`manifest_checkpoints`, :func:`manifest_entries`)
are model 0's epoch checkpoints in epoch order, then its final checkpoint, then model 1's, ...:
without epoch checkpoints, the final checkpoints in model_id order.

The callback for transformers' ``Trainer`` (:class:`trakcli.integrations.TrakCallback`) writes the same format with
``"source": "trainer"`` (absent: `trak optimize`), one model, ``recipe: {"trainer": {...}, "callback": {...}}``, and
entries that carry the optimizer step: ``{"step": 500, "epoch": 1, "checkpoint": ..., ...}`` for a save at an epoch's
end, ``{"step": 500, "checkpoint": ..., ...}`` (no ``epoch``) for a save every N steps; an entry of
``epoch_checkpoints`` has an integer ``epoch`` or ``step``, listed in training order.

This module imports neither torch nor zarr at import time (the CLI reads configs before importing torch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trakcli.errors import ConfigError
from trakcli.files import write_text
from trakcli.store.hashes import HashCache

MANIFEST_NAME = "manifest.json"
FORMAT = "trakcli.optimize.manifest"
FORMAT_VERSION = 1
#: ``"source"`` of a manifest written by :class:`trakcli.integrations.TrakCallback` during ``Trainer`` training.
SOURCE_TRAINER = "trainer"


def checkpoint_file_name(model_id: int, *, epoch: int | None = None, step: int | None = None,
                         adapter: bool = False) -> str:
    """The file (or PEFT ``adapter`` folder, without ``.pt``) name of a model's checkpoint in a manifest's folder:
    ``model_000_epoch{epoch}.pt``, ``model_000_step{step}.pt``, or the final ``model_000.pt`` (``000``: model_id)."""
    stem = f"model_{model_id:03d}"
    stem += f"_epoch{epoch}" if epoch is not None else f"_step{step}" if step is not None else ""
    return stem if adapter else f"{stem}.pt"


def checkpoint_sha256(path: Path) -> str:
    """:func:`trakcli.models.file_sha256` of ``path`` (imported here: this module must not import torch)."""
    from trakcli.models import file_sha256

    return file_sha256(path)


def is_manifest_path(spec: Any) -> bool:
    """Whether a ``checkpoints:`` value names a manifest (a single ``.json`` path) rather than checkpoints."""
    return isinstance(spec, (str, Path)) and str(spec).lower().endswith(".json")


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` to ``path`` atomically; ConfigError naming the path if it cannot be written."""
    try:
        write_text(path, json.dumps(manifest, indent=1) + "\n")
    except OSError as e:
        raise ConfigError(f"optimize.out_dir: cannot write the manifest {str(path)!r}: {e}") from None


def read_manifest(path: Path, *, key: str = "checkpoints") -> dict[str, Any]:
    """The manifest at ``path`` (named by the config key ``key``), its structure checked, ``models`` sorted by
    model_id; ConfigError if the file is missing, not JSON, or not a trak optimize manifest."""
    if not path.is_file():
        raise ConfigError(f"{key}: manifest {str(path)!r} does not exist; run `trak optimize CONFIG` to train the "
                          "models (it writes the manifest into its out_dir), or point checkpoints at your .pt / "
                          ".safetensors files")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{key}: cannot read the manifest {str(path)!r} ({e.__class__.__name__}: {e}); rerun "
                          "`trak optimize CONFIG` to rewrite it") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"{key}: {str(path)!r} is not a manifest of `trak optimize` (no \"format\": {FORMAT!r}); "
                          "give the manifest.json in optimize.out_dir, or a glob / list of checkpoint files")
    if data.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{key}: the manifest {str(path)!r} has format_version {data.get('format_version')!r}, this "
                          f"trakcli reads {FORMAT_VERSION}; rerun `trak optimize CONFIG` to rewrite it")
    models = data.get("models")
    ok = isinstance(models, list) and all(
        isinstance(m, dict) and isinstance(m.get("model_id"), int) and isinstance(m.get("checkpoint"), str)
        and isinstance(m.get("sha256"), str) and _epochs_ok(m.get("epoch_checkpoints")) for m in models
    ) and sorted(m["model_id"] for m in models) == list(range(len(models)))
    if not ok or not isinstance(data.get("n_models"), int):
        raise ConfigError(f"{key}: the manifest {str(path)!r} is damaged (n_models, or models with model_id 0, 1, ... "
                          "each with checkpoint and sha256 and, if listed, epoch_checkpoints of epoch, checkpoint and "
                          "sha256, expected); rerun `trak optimize CONFIG` to rewrite it")
    data["models"] = sorted(models, key=lambda m: m["model_id"])
    return data


def _epochs_ok(epochs: Any) -> bool:
    """Whether a model's ``epoch_checkpoints`` is absent or a list of ``{epoch or step, checkpoint, sha256}``."""
    return epochs is None or isinstance(epochs, list) and all(
        isinstance(e, dict) and isinstance(e.get("epoch", e.get("step")), int) and isinstance(e.get("checkpoint"), str)
        and isinstance(e.get("sha256"), str) for e in epochs)


def manifest_entries(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every checkpoint a manifest (as :func:`read_manifest` returns it) lists, in the order featurize numbers them:
    per checkpoint ``{"checkpoint", "sha256", "optimizer_state" (or None), "what"}``, each model's
    ``epoch_checkpoints`` then its final one; ``what`` names it (``"model 3, epoch 2"``, ``"model 0, step 500"``)."""
    out = []
    for m in manifest["models"]:
        epochs = m.get("epoch_checkpoints")
        for item in epochs if isinstance(epochs, list) else []:
            at = f"epoch {item['epoch']}" if "epoch" in item else f"step {item['step']}"
            out.append({"checkpoint": item["checkpoint"], "sha256": item.get("sha256"),
                        "optimizer_state": item.get("optimizer_state"), "what": f"model {m['model_id']}, {at}"})
        out.append({"checkpoint": m["checkpoint"], "sha256": m.get("sha256"),
                    "optimizer_state": m.get("optimizer_state"), "what": f"model {m['model_id']}"})
    return out


def manifest_checkpoints(path: Path, *, n_models: int | None = None, n_models_key: str = "optimize.n_models",
                         hashes: HashCache | None = None) -> list[Path]:
    """The checkpoint paths a finished run lists in its manifest ``path`` (relative to its directory), in the order
    of :func:`manifest_entries`, each file still with the sha256 the manifest recorded.

    Args:
        n_models: the number of models the config's recipe asks for (spelled ``n_models_key``), when its
            ``out_dir`` is this manifest's directory (None: not checked).
        hashes: remembers the sha256s (None: hash every file).

    Raises:
        ConfigError: everything wrong at once: an invalid manifest, an unfinished run, missing checkpoint
            files, or checkpoints that changed since the manifest was written.
    """
    data = read_manifest(path)
    models = data["models"]
    problems: list[str] = []
    trainer = data.get("source") == SOURCE_TRAINER
    redo = "train the model again with TrakCallback" if trainer else "rerun `trak optimize CONFIG` to train it again"
    if trainer and not data.get("complete"):
        problems.append(f"checkpoints: the manifest {str(path)!r} is of a Trainer training that did not end "
                        "(TrakCallback marks it complete in on_train_end; was it stopped?); let the training finish "
                        "(or resume it with trainer.train(resume_from_checkpoint=...)), or list the checkpoint files "
                        "in checkpoints: to use them")
    elif not data.get("complete") or len(models) < data["n_models"]:
        problems.append(f"checkpoints: the manifest {str(path)!r} lists {len(models)} of the {data['n_models']} "
                        "models of its run: `trak optimize` did not finish (was it stopped?); "
                        "rerun `trak optimize CONFIG` to train the rest (it resumes where it stopped), then featurize")
    elif n_models is not None and n_models != len(models):
        fix = ("run `trak optimize CONFIG` to train the missing ones" if n_models > len(models) else
               f"set {n_models_key}={len(models)}, or rerun `trak optimize CONFIG` to rewrite the manifest")
        problems.append(f"checkpoints: the manifest {str(path)!r} lists {len(models)} models but {n_models_key} is "
                        f"{n_models}; {fix}")
    out = []
    for m in manifest_entries(data):
        ckpt = path.parent / m["checkpoint"]
        out.append(ckpt)
        if not ckpt.exists():  # a file, or an adapter folder (optimize.lora)
            problems.append(f"checkpoints: checkpoint {str(ckpt)!r} ({m['what']}) of the manifest {str(path)!r} "
                            f"does not exist; {redo}")
        elif (sha := hashes.sha256(ckpt, checkpoint_sha256) if hashes else checkpoint_sha256(ckpt)) != m["sha256"]:
            problems.append(f"checkpoints: checkpoint {str(ckpt)!r} ({m['what']}) changed since "
                            f"{'TrakCallback' if trainer else 'trak optimize'} wrote the manifest (sha256 "
                            f"{m['sha256'][:12]} then, {sha[:12]} now); delete it and {redo}, or list the checkpoint "
                            "files in checkpoints: to use them as they are")
    if problems:
        raise ConfigError(problems)
    return out
