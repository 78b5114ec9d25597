"""Resolving the files a config names: checkpoints (globs, lists, hf: directories, manifests) and data files.

The jobs resolve their inputs here; :mod:`trakcli.config` only validates the YAML.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import TYPE_CHECKING

from trakcli.config.schema import Config
from trakcli.errors import ConfigError, DataError, ModelError
from trakcli.files import file_problem

if TYPE_CHECKING:
    from trakcli.store.hashes import HashCache


def resolve_checkpoints(cfg: Config, hashes: "HashCache | None" = None) -> list[Path]:
    """The checkpoint files of ``cfg`` in model_id order (a glob's matches sorted; a list in its order).

    ``hf:DIR`` (or ``hf:package/dir``, or a Hub name ``hf:ORG/NAME[@REVISION][/FOLDER]``: its snapshot in the
    cache) is a Hugging Face model or PEFT adapter directory, found as for ``model.entrypoint``. A single
    ``.json`` path is a `trak optimize` ``manifest.json``: its checkpoints (relative to it), their sha256s
    checked through ``hashes`` if given (:func:`trakcli.store.manifest.manifest_checkpoints`).

    Raises:
        ConfigError: a glob matching nothing, a listed file missing; a manifest missing, invalid, of an
            unfinished run (fewer models than its n_models, or than the config's when its out_dir is the
            manifest's folder), or with a checkpoint missing or changed since.
    """
    spec = cfg.checkpoints
    from trakcli.store.manifest import is_manifest_path, manifest_checkpoints

    if is_manifest_path(spec):
        path, oc = Path(spec), cfg.recipe  # type: ignore[arg-type]
        ours = oc is not None and oc.out_dir is not None and oc.out_dir.resolve() == path.parent.resolve()
        return manifest_checkpoints(path, n_models=oc.n_models if ours else None, n_models_key="optimize.n_models",
                                    hashes=hashes)
    listed = [spec] if isinstance(spec, str) else spec
    if any(p.startswith("hf:") for p in listed):
        from trakcli.models.hf import resolve_hf_path

        out, problems = [], []
        for p in listed:
            try:
                out.append(resolve_hf_path(p, need="checkpoint") if p.startswith("hf:") else Path(p))
            except ModelError as e:
                problems.append(f"checkpoints: {e}")
        missing = [p for p in out if not p.exists()]
        problems += [f"checkpoints: file {str(p)!r} does not exist" for p in missing]
        if problems:
            raise ConfigError(problems)
        return out
    if isinstance(spec, str):
        matches = sorted(glob.glob(spec))
        if not matches and Path(spec).exists():
            matches = [spec]
        if not matches:
            raise ConfigError(f"checkpoints: no file matches {spec!r}; train some with `trak optimize CONFIG` "
                              "or point the glob at your .pt / .safetensors files")
        return [Path(m) for m in matches]
    missing = [p for p in spec if not Path(p).exists()]
    if missing:
        raise ConfigError([f"checkpoints: file {p!r} does not exist" for p in missing])
    if not spec:
        raise ConfigError("checkpoints: the list is empty; give at least one checkpoint file")
    return [Path(p) for p in spec]


#: The folder beside a checkpoint that holds its optimizer state (what `trak optimize` writes with
#: ``save_optimizer_state``; ``trakcli.jobs.optimize.OPTIMIZER_STATE_DIR``).
OPTIMIZER_STATE_DIR = "optimizer_state"


def resolve_optimizer_states(cfg: Config, checkpoints: list[Path]) -> list[Path]:
    """The optimizer state file of each checkpoint (``second_moment:``), in model_id order:
    ``second_moment.optimizer_state``'s glob (sorted) or list; unset, for a `trak optimize` manifest the
    ``optimizer_state`` each entry records, otherwise ``<checkpoint's folder>/optimizer_state/<checkpoint's
    name>`` (where `trak optimize` writes it with ``optimize.save_optimizer_state: true``).

    Raises:
        ConfigError: one line: a checkpoint without a state file (the first, with its expected path and how many
            more lack one), or a glob / list whose count is not the number of checkpoints.
    """
    from trakcli.gradients.second_moment import SAVE_HINT
    from trakcli.store.manifest import is_manifest_path, manifest_entries, read_manifest

    spec = cfg.second_moment.optimizer_state
    if spec is not None:
        states = [Path(p) for p in (sorted(glob.glob(spec)) or [spec] if isinstance(spec, str) else spec)]
        if len(states) != len(checkpoints):
            raise ConfigError(f"second_moment.optimizer_state: {spec!r} names {len(states)} files for "
                              f"{len(checkpoints)} checkpoints; give one optimizer state file per checkpoint, in "
                              "model_id order")
    elif is_manifest_path(cfg.checkpoints):
        manifest = Path(cfg.checkpoints)  # type: ignore[arg-type]
        states = []
        for entry, ckpt in zip(manifest_entries(read_manifest(manifest)), checkpoints):
            recorded = entry.get("optimizer_state")
            states.append(manifest.parent / recorded if isinstance(recorded, str)
                          else ckpt.parent / OPTIMIZER_STATE_DIR / ckpt.name)
    else:
        states = [Path(c).parent / OPTIMIZER_STATE_DIR / Path(c).name for c in checkpoints]
    missing = [(i, s) for i, s in enumerate(states) if not s.is_file()]
    if missing:
        i, path = missing[0]
        more = f", and {len(missing) - 1} more checkpoints lack theirs" if len(missing) > 1 else ""
        raise ConfigError(f"second_moment.kind {cfg.second_moment.kind}: no optimizer state {str(path)!r} for "
                          f"checkpoint {str(checkpoints[i])!r} (model_id {i}){more}; {SAVE_HINT}")
    return states


def _not_a_file(key: str, path: str | Path, wanted: str) -> str:
    """The problem line of a config key naming a path that is no readable file (:func:`trakcli.files.file_problem`)."""
    problem = file_problem(path)
    if problem == "does not exist":
        return f"{key}: file {str(path)!r} does not exist"
    return f"{key}: {str(path)!r} {problem}; give {wanted}"


def missing_train_files(cfg: Config) -> list[str]:
    """The local files of ``data.train`` that are not there, as written in the config (Hub datasets and built-in
    splits are never missing)."""
    paths = cfg.data.train.paths if cfg.data.train is not None else []
    return [str(p) for p in paths if not (isinstance(p, str) and "://" in p) and file_problem(p) is not None]


def check_files(cfg: Config, *, need_checkpoints: bool = True, need_target: bool = False,
                need_validation: bool = False, need_train: bool = True) -> None:
    """Check that every file the config names exists; report all missing ones at once.

    Args:
        cfg: the validated config.
        need_checkpoints: resolve ``checkpoints`` (featurize, score).
        need_target: ``data.target`` must be given (score).
        need_validation: check ``data.validation``'s file too (optimize).
        need_train: check ``data.train``'s files (False: a score of a store whose train file is gone).

    Raises:
        ConfigError: one line per missing file or glob matching nothing.
    """
    problems: list[str] = []
    if need_checkpoints:
        from trakcli.store.hashes import HashCache

        try:
            resolve_checkpoints(cfg, HashCache.for_store(cfg.store.path))
        except ConfigError as e:
            problems += e.problems
    for name in [n for n, need in (("train", need_train), ("target", True), ("validation", need_validation)) if need]:
        ds = getattr(cfg.data, name)
        if ds is None:
            if name == "target" and need_target:
                problems.append("data.target: required to score; give a builtin split or a file")
            continue
        for path in ds.paths:
            if isinstance(path, str) and path.startswith("hf://"):  # a Hub dataset: downloaded or in the cache
                from trakcli.models.hub import resolve_hub_dataset

                try:
                    resolve_hub_dataset(path, key=f"data.{name}")
                except DataError as e:
                    problems.append(str(e))
            elif file_problem(path) is not None:
                problems.append(_not_a_file(f"data.{name}.path", path, "a .pt, .npz or text data file"))
    ep = cfg.model.entrypoint
    if ep.startswith("hf:"):
        from trakcli.models.hf import resolve_hf_path

        try:
            resolve_hf_path(ep)
        except ModelError as e:
            problems.append(str(e))
    elif ":" in ep:
        file_part = ep.rsplit(":", 1)[0]
        if file_part.endswith(".py") and file_problem(file_part) is not None:
            problems.append(_not_a_file("model.entrypoint", file_part, "the Python file that defines the function"))
    if problems:
        raise ConfigError(problems)
