"""The per-checkpoint curvature ``train/<model_id>/curvature``: K-FAC / EK-FAC factors, written in stages.

Layout (every array in the factors' own dtype, float32 or float64, one chunk each; ``i`` the layer's index)::

    train/<model_id>/curvature/        attrs: settings (kind, fisher, damping, ...), stage
        cov/<i>/a  [d_in, d_in]        stage "covariances": the factors A and S of pass 1
        cov/<i>/s  [d_out, d_out]
        <i>/q_out, <i>/q_in, <i>/eig   stage "done": eigenbases and (corrected) eigenvalues
        partial/                       attrs: pass, slot, rows, tokens, device (the running pass's saved state)
          <slot>/<i>/a, <slot>/<i>/s   pass "covariances": the running sums Σ a aᵀ, Σ g gᵀ
          <slot>/<i>/eig               pass "eigenvalues": the running sums Σ (Q_Sᵀ G Q_A)²
          <slot>/rng  [k] uint8        the label sampler's state

A stage's arrays are written before the attribute that names it, so a killed fit resumes after the last
finished stage. Within a pass, the running sums are saved every ``store.save_every_s`` seconds of work into
the slot the attributes do not name (:func:`write_partial`), so a kill during a save leaves the previous one
whole; a finished stage deletes ``partial``. Attributes made with other settings mean nothing is reused; a
corrupt array is deleted (noted in ``store.notes``) and fitted again.

Exact scores (:class:`trakcli.jobs.exact.ExactInfluence`) keep the progress of the train rows
they are scoring the same way, under ``scores/<experiment>/exact_rows`` (:func:`write_exact_rows`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from trakcli.errors import StoreError
from trakcli.store.integrity import StoreCorruptError, attrs_of, delete, node
from trakcli.store.kernel import train_group, write_array
from trakcli.store.layout import jsonable
from trakcli.store.rows import read_checked

if TYPE_CHECKING:
    from trakcli.store.store import Store

#: The stages of a fit, in order.
STAGES = ("covariances", "done")


def _path(model_id: int) -> str:
    return f"train/{model_id}/curvature"


def read_curvature(store: "Store", model_id: int, settings: dict[str, Any], stage: str
                   ) -> dict[str, np.ndarray] | None:
    """The arrays of a finished ``stage`` (``cov/<i>/a`` ... or ``<i>/q_out`` ...), checksums verified. None when the
    stage is not finished with ``settings``, or when an array is corrupt or missing (then the curvature is deleted and
    ``store.notes`` says so, so that it is fitted again)."""
    attrs = attrs_of(store.root, _path(model_id)) or {}  # the last finished stage, and its settings
    have = attrs.get("stage")
    if have not in STAGES or attrs.get("settings") != jsonable(settings) or STAGES.index(have) < STAGES.index(stage):
        return None
    path = _path(model_id)
    group = node(store.root, path)
    prefix = "cov/" if stage == "covariances" else ""
    out: dict[str, np.ndarray] = {}
    try:
        for name, member in sorted(group.members(max_depth=None), key=lambda m: m[0]):
            top = name.split("/")[0]
            if hasattr(member, "shape") and top != "partial" and (top == "cov") == (stage == "covariances"):
                out[name[len(prefix):]] = read_checked(member, slice(None), 0)
    except StoreCorruptError:
        delete(store.root, path, metadata_only=False)
        store.notes.append(f"model_id {model_id}: the stored curvature was corrupt or missing; it is fitted again")
        return None
    return out


def write_curvature(store: "Store", model_id: int, settings: dict[str, Any], stage: str,
                    arrays: dict[str, np.ndarray]) -> None:
    """Write one stage's arrays, then the attributes naming the stage (the done marker); rank 0.

    Args:
        model_id: the checkpoint (its ``train/<model_id>`` group must exist).
        settings: what the curvature is made with (compared on every read).
        stage: ``covariances`` (``arrays`` named ``<i>/a``, ``<i>/s``, stored under ``cov/``) or
            ``done`` (``<i>/q_out``, ``<i>/q_in``, ``<i>/eig``).
        arrays: float32 or float64 numpy arrays by name (written in their dtype; any other as float64).

    Raises:
        StoreError: the write failed (rerun to resume), or the checkpoint's group is missing.
    """
    try:
        group = _settings_group(store, model_id, settings)
        prefix = "cov/" if stage == "covariances" else ""
        for name, a in arrays.items():
            write_array(group, f"{prefix}{name}", _float(a))
        group.attrs.update({"stage": stage})
        delete(group, "partial", metadata_only=False)  # the finished pass's saved sums
    except OSError as e:
        raise StoreError(f"writing the curvature of model_id {model_id} failed: {e}; rerun to resume") from None


def _settings_group(store: "Store", model_id: int, settings: dict[str, Any]) -> Any:
    """The curvature group of checkpoint ``model_id``, made with ``settings`` (one made with others is deleted first);
    StoreError if the checkpoint's train group is missing."""
    train_group(store, model_id)
    path = _path(model_id)
    group = node(store.root, path)
    if group is not None and dict(group.attrs).get("settings") != jsonable(settings):
        delete(store.root, path, metadata_only=False)  # made with other settings: start over
        group = None
    if group is None:
        group = store.root.require_group(path)
    if dict(group.attrs).get("settings") != jsonable(settings):
        group.attrs.update({"settings": jsonable(settings)})
    return group


def _float(a: Any) -> np.ndarray:
    a = np.asarray(a)
    return np.ascontiguousarray(a, dtype=a.dtype if a.dtype in (np.float32, np.float64) else np.float64)


def write_partial(store: "Store", model_id: int, settings: dict[str, Any], pass_name: str, rows: int,
                  sums: dict[str, np.ndarray], tokens: list[int], rng: np.ndarray | None, device: str) -> None:
    """Save the running sums of a fitting pass after ``rows`` rows (rank 0): into the slot the attributes do not
    name, then the attributes (one atomic write) name it; the slot they named before stays whole until then.

    Args:
        model_id, settings: as :func:`write_curvature`.
        pass_name: ``covariances`` or ``eigenvalues``.
        rows: rows in the sums (the end of a batch).
        sums: float32 or float64 arrays by name (``<i>/a``, ``<i>/s`` or ``<i>/eig``).
        tokens: per layer, the tokens in ``A`` (pass 1), else empty.
        rng: the label sampler's state ``[k]`` uint8, or None.
        device: the sampler's device type.

    Raises:
        StoreError: the write failed (rerun to resume from the previous save), or the checkpoint's group is missing.
    """
    try:
        group = _settings_group(store, model_id, settings)
        part = node(group, "partial")
        attrs = dict(part.attrs) if part is not None else {}
        if part is None:
            part = group.require_group("partial")
        slot = 1 - int(attrs.get("slot", 1)) if attrs.get("pass") == pass_name else 0
        for name, a in sums.items():
            write_array(part, f"{slot}/{name}", _float(a), reuse=True)
        if rng is not None:
            write_array(part, f"{slot}/rng", np.ascontiguousarray(np.asarray(rng, dtype=np.uint8)), reuse=True)
        part.attrs.update({"pass": pass_name, "slot": slot, "rows": int(rows), "tokens": [int(t) for t in tokens],
                           "rng": rng is not None, "device": device, "names": sorted(sums)})
    except OSError as e:
        raise StoreError(f"saving the curvature fit of model_id {model_id} failed: {e}; rerun to resume") from None


def read_partial(store: "Store", model_id: int, settings: dict[str, Any], pass_name: str) -> dict[str, Any] | None:
    """The last save of pass ``pass_name`` (:func:`write_partial`) made with ``settings``, or None.

    Returns:
        ``{"rows", "sums" (name -> array), "tokens", "rng" (uint8 array or None), "device"}``. None when nothing
        of that pass is saved with these settings, or when an array of the save is corrupt or missing (then
        the saved state is deleted and ``store.notes`` says so: the pass starts over).
    """
    try:
        group = node(store.root, _path(model_id))
        if group is None or dict(group.attrs).get("settings") != jsonable(settings):
            return None
        part = node(group, "partial")
        attrs = dict(part.attrs) if part is not None else {}
    except StoreCorruptError:
        attrs, part = {}, None
    if attrs.get("pass") != pass_name:
        return None
    slot = int(attrs["slot"])
    try:
        sums = {name: read_checked(_need(part, f"{slot}/{name}"), slice(None), 0) for name in attrs["names"]}
        rng = read_checked(_need(part, f"{slot}/rng"), slice(None), 0) if attrs.get("rng") else None
    except StoreCorruptError:
        delete(group, "partial", metadata_only=False)
        store.notes.append(f"model_id {model_id}: the saved sums of the curvature's {pass_name} pass were corrupt or "
                           "missing; the pass starts over")
        return None
    return {"rows": int(attrs["rows"]), "sums": sums, "tokens": list(attrs.get("tokens", [])), "rng": rng,
            "device": attrs.get("device", "cpu")}


def _need(group: Any, name: str) -> Any:
    arr = node(group, name)
    if arr is None:
        raise StoreCorruptError(f"array {name} of a saved curvature pass is missing", name)
    return arr


# -- exact scores: the progress of the train rows being scored ------------------------------------------------------

def _exact_path(experiment: str, lo: int, hi: int) -> str:
    return f"scores/{experiment}/exact_rows/{lo}-{hi}"


def read_exact_rows(store: "Store", experiment: str, lo: int, hi: int, n_models: int, n_target: int
                    ) -> tuple[int, int, np.ndarray] | None:
    """The saved progress of the exact scores of train rows ``[lo, hi)`` (:func:`write_exact_rows`), or None.

    Returns:
        ``(model_id, rows, sums)``: the scores' running sums hold checkpoints ``0 .. model_id`` for the first
        ``rows`` rows and ``0 .. model_id - 1`` for the others; ``sums`` ``[n_target + 1, hi - lo]`` float64,
        the targets' summed scores and (last row) the summed ``Q``. None when nothing is saved (or it is
        unreadable: then it is deleted and the rows are scored from their first).
    """
    path = _exact_path(experiment, lo, hi)
    try:
        group = node(store.root, path)
        attrs = dict(group.attrs) if group is not None else {}
        if not attrs or attrs.get("n_models") != n_models or attrs.get("n_target") != n_target:
            return None
        model_id, rows = int(attrs["model"]), int(attrs["rows"])
        sums = np.zeros((n_target + 1, hi - lo), dtype=np.float64)
        for m, start, stop in attrs["pieces"]:  # checkpoint model_id's columns before `rows`, the one before's after
            a, b = (start, min(stop, rows)) if m == model_id else (max(start, rows), stop)
            if a < b:
                piece = read_checked(_need(group, f"{m}/{start}-{stop}"), slice(None), 0)
                sums[:, a:b] = piece[:, a - start:b - start]
        return model_id, rows, sums
    except StoreCorruptError:
        delete(store.root, path, metadata_only=False)
        store.notes.append(f"the saved exact scores of train rows {lo}-{hi} were corrupt or missing; scored again")
        return None


def write_exact_rows(store: "Store", experiment: str, lo: int, hi: int, n_models: int, n_target: int,
                     model_id: int, start: int, rows: int, piece: np.ndarray) -> None:
    """Save the exact scores' running sums of train rows ``[lo + start, lo + rows)`` after checkpoint ``model_id``
    (by the one process scoring the rows; StoreError if the write fails): only the columns scored since the save
    before (``piece`` ``[n_target + 1, rows - start]`` float64, as :func:`read_exact_rows` returns them), then the
    attributes naming the position (one atomic write); pieces no longer needed are deleted after."""
    path = _exact_path(experiment, lo, hi)
    try:
        group = node(store.root, path)
        attrs = dict(group.attrs) if group is not None else {}
        if attrs and (attrs.get("n_models") != n_models or attrs.get("n_target") != n_target):
            delete(store.root, path, metadata_only=False)
            group, attrs = None, {}
        if group is None:
            group = store.root.require_group(path)
        pieces = [[m, a, b] for m, a, b in attrs.get("pieces", [])  # what a read at the new position needs
                  if m == model_id and a < start or m == model_id - 1 and b > rows]
        name = f"{model_id}/{start}-{rows}"
        write_array(group, name, np.ascontiguousarray(piece, dtype=np.float64))
        group.attrs.update({"n_models": n_models, "n_target": n_target, "model": model_id, "rows": rows,
                            "pieces": pieces + [[model_id, start, rows]]})
        for m, a, b in attrs.get("pieces", []):
            if [m, a, b] not in pieces and f"{m}/{a}-{b}" != name:
                delete(group, f"{m}/{a}-{b}", metadata_only=False)
    except OSError as e:
        raise StoreError(f"saving the exact scores of train rows {lo}-{hi} failed: {e}; rerun to resume") from None


def drop_exact_rows(store: "Store", experiment: str, lo: int | None = None, hi: int | None = None) -> None:
    """Delete the saved progress of the exact scores of rows ``[lo, hi)``, or of every row range (no ``lo``)."""
    delete(store.root, f"scores/{experiment}/exact_rows" if lo is None else _exact_path(experiment, lo, hi),
           metadata_only=False)
