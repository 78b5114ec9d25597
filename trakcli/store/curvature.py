"""The per-checkpoint curvature ``train/<model_id>/curvature``: K-FAC / EK-FAC factors, written in stages.

Layout (every array in the factors' own dtype, float32 or float64, one chunk each; ``i`` the layer's index)::

    train/<model_id>/curvature/        attrs: settings (kind, fisher, damping, ...), stage
        cov/<i>/a  [d_in, d_in]        stage "covariances": the factors A and S of pass 1
        cov/<i>/s  [d_out, d_out]
        <i>/q_out, <i>/q_in, <i>/eig   stage "done": eigenbases and (corrected) eigenvalues

A stage's arrays are written before the attribute that names it, so a killed fit
resumes after the last finished stage (pass 1 is not repeated once its covariances
are stored). Attributes made with other settings mean nothing is reused. Curvature is
derived data: a corrupt array is deleted (noted in ``store.notes``) and fitted again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from trakcli.errors import StoreError
from trakcli.store.identity import jsonable
from trakcli.store.integrity import StoreCorruptError, delete, node, writable
from trakcli.store.rows import codecs, read_checked

if TYPE_CHECKING:
    from trakcli.store.store import Store

#: The stages of a fit, in order.
STAGES = ("covariances", "done")


def _path(model_id: int) -> str:
    return f"train/{model_id}/curvature"


def curvature_stage(store: "Store", model_id: int, settings: dict[str, Any]) -> str | None:
    """The last finished stage of checkpoint ``model_id``'s curvature made with ``settings`` (None: nothing)."""
    try:
        group = node(store.root, _path(model_id))
        if group is None:
            return None
        attrs = dict(group.attrs)
    except StoreCorruptError:
        return None
    if attrs.get("settings") != jsonable(settings):
        return None
    stage = attrs.get("stage")
    return stage if stage in STAGES else None


def read_curvature(store: "Store", model_id: int, settings: dict[str, Any], stage: str
                   ) -> dict[str, np.ndarray] | None:
    """The arrays of a finished ``stage`` (``cov/<i>/a`` ... or ``<i>/q_out`` ...), checksums verified.

    None when the stage is not finished with ``settings``, or when an array is corrupt or missing
    (then the curvature is deleted and ``store.notes`` says so, so that it is fitted again).
    """
    have = curvature_stage(store, model_id, settings)
    if have is None or STAGES.index(have) < STAGES.index(stage):
        return None
    path = _path(model_id)
    group = node(store.root, path)
    prefix = "cov/" if stage == "covariances" else ""
    out: dict[str, np.ndarray] = {}
    try:
        names = sorted(_array_names(group))
        for name in names:
            if prefix and not name.startswith(prefix) or not prefix and name.startswith("cov/"):
                continue
            out[name[len(prefix):]] = read_checked(node(group, name), slice(None), 0)
    except StoreCorruptError:
        delete(store.root, path, metadata_only=False)
        store.notes.append(f"model_id {model_id}: the stored curvature was corrupt or missing; it is fitted again")
        return None
    return out


def _array_names(group: Any, prefix: str = "") -> list[str]:
    names = []
    for name, member in group.members():
        full = f"{prefix}{name}"
        if hasattr(member, "members"):
            names += _array_names(member, full + "/")
        else:
            names.append(full)
    return names


def write_curvature(store: "Store", model_id: int, settings: dict[str, Any], stage: str,
                    arrays: dict[str, np.ndarray]) -> None:
    """Write one stage's arrays, then the attributes naming the stage (the done marker).

    Args:
        store: the open store (rank 0).
        model_id: the checkpoint (its ``train/<model_id>`` group must exist).
        settings: what the curvature is made with (compared on every read).
        stage: ``covariances`` (``arrays`` named ``<i>/a``, ``<i>/s``, stored under ``cov/``) or
            ``done`` (``<i>/q_out``, ``<i>/q_in``, ``<i>/eig``).
        arrays: float32 or float64 numpy arrays by name (written in their dtype; any other as float64).

    Raises:
        StoreError: the write failed (rerun to resume), or the checkpoint's group is missing.
    """
    if node(store.root, f"train/{model_id}") is None:
        raise StoreError(f"store group train/{model_id} is missing; run `trak featurize CONFIG` first")
    path = _path(model_id)
    try:
        group = node(store.root, path)
        if group is not None and dict(group.attrs).get("settings") != jsonable(settings):
            delete(store.root, path, metadata_only=False)  # made with other settings: start over
            group = None
        if group is None:
            group = store.root.require_group(path)
        group.attrs.update({"settings": jsonable(settings)})
        prefix = "cov/" if stage == "covariances" else ""
        for name, a in arrays.items():
            a = np.asarray(a)
            a = np.ascontiguousarray(a, dtype=a.dtype if a.dtype in (np.float32, np.float64) else np.float64)
            full = f"{prefix}{name}"
            if node(group, full) is not None:
                delete(group, full, metadata_only=False)
            arr = group.create_array(full, shape=a.shape, chunks=a.shape or None, dtype=a.dtype.name, fill_value=0,
                                     compressors=codecs("none"))
            writable(arr)[...] = a
        group.attrs.update({"stage": stage})
    except OSError as e:
        raise StoreError(f"writing the curvature of model_id {model_id} failed: {e}; rerun to resume") from None
