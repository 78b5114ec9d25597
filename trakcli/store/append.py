"""Growing a featurized store: train rows appended after the rows it was featurized with.

A run whose train data holds *more* rows than the store's, the first ``n_old`` of them with the store's
fingerprint (``identity.train_data``), and whose other settings are the store's, is an *append*:
:func:`grow_if_appended` grows the store in place, so that `trak featurize` computes only the new rows.
Anything else is refused as before, naming what differs.

Growing, in this order (each step can be repeated; the root attributes, written last, commit the append):

1. per checkpoint ``train/<m>``: the old last chunk, if partly filled and done, has its ``done`` flag
   cleared, then its kept rows recorded (attribute ``appended_into``: ``{"chunk", "kept_rows"}``,
   :func:`kept_rows`);
2. its kernel is deleted, after the Gram ``ΦᵀΦ`` of the old rows is recovered from a primal kernel ``L``
   (``L Lᵀ − λI``) as ``gram_prefix`` (:func:`trakcli.store.kernel.save_gram_prefix`);
3. its row arrays (with an int8 or binary store's codes), ``rows_done`` and ``done`` are resized;
4. every scored experiment is marked ``stale`` (the ``n_train`` and ``sha256`` it was scored over), and
   reading its scores refuses, naming the rescore (:func:`stale_error`);
5. the root attributes: the new ``identity`` and ``layout``, one entry more in ``appends``.

K-FAC / EK-FAC stores are not grown: their curvature, fitted over all train rows, whitens every feature.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from trakcli.errors import Fix, Note, StoreError, StoreMismatchError
from trakcli.store.integrity import delete, keys, node, writable
from trakcli.store.kernel import save_gram_prefix
from trakcli.store.layout import LAYOUT_ATTR, differing_keys, jsonable
from trakcli.store.quantize import CODE_ARRAYS
from trakcli.store.rows import drop_all_done, read_entry

if TYPE_CHECKING:
    from trakcli.store.layout import StoreLayout
    from trakcli.store.store import Store

#: Root attribute: the appends a store has grown by, oldest first.
APPENDS_ATTR = "appends"
#: Attribute of ``train/<m>``: the old partly filled chunk an append grew, and its rows kept.
KEPT_ATTR = "appended_into"
#: Attribute of ``scores/<experiment>``: the train rows the experiment was scored over, set when the store grew.
STALE_ATTR = "stale"

#: The identity keys an append may change (the train data's row count and hash).
GROWING_KEYS = {"train_data.n", "train_data.sha256"}


class StoreStaleError(StoreError):
    """Scores read or rescored after the store's train rows grew, without ``--overwrite``."""


def appended_rows(old: dict[str, Any] | None, new: dict[str, Any], old_layout: Any, layout: "StoreLayout",
                  ) -> int | None:
    """The store's row count ``n_old`` if this run's identity ``new`` and ``layout`` differ from the recorded
    ``old`` and ``old_layout`` only by more train rows (``train_data.n`` / ``sha256``, ``n_train``), else None.
    Whether the first ``n_old`` rows are unchanged is :func:`grow_if_appended`'s check."""
    if not isinstance(old, dict) or not isinstance(old_layout, dict):
        return None
    new = jsonable(new)
    diff = set(differing_keys(old, new))
    if not diff or not diff <= GROWING_KEYS:
        return None
    now = jsonable(layout.to_attrs())
    if {k: v for k, v in old_layout.items() if k != "n_train"} != {k: v for k, v in now.items() if k != "n_train"}:
        return None
    n_old, n_new = old.get("train_data", {}).get("n"), new["train_data"].get("n")
    if not isinstance(n_old, int) or not isinstance(n_new, int) or n_old != old_layout.get("n_train"):
        return None
    return n_old if n_new > n_old else None


def grow_if_appended(store: "Store", identity: dict[str, Any], layout: "StoreLayout",
                     prefix: Callable[[int], dict[str, Any]]) -> bool:
    """Grow ``store`` (rank 0, under its lock) to this run's train rows if they extend the store's; returns whether
    it grew (its identity and layout are now this run's ``identity`` and ``layout``). ``prefix(n)``: the
    fingerprint of the first ``n`` train rows of this run's data.

    Raises:
        StoreMismatchError: the rows extend the store's count but the first ``n_old`` differ from the featurized
            ones, or the store's features are whitened by a K-FAC / EK-FAC curvature (names ``--overwrite``).
        StoreError: the store cannot be written (nothing computed is lost; rerun to resume).
    """
    attrs = store.root.attrs
    old = attrs.get("identity")
    n_old = appended_rows(old, identity, attrs.get(LAYOUT_ATTR), layout)
    if n_old is None:
        return False
    n_new = layout.n_train
    where = f"store {store.path}"
    if "curvature" in old:
        raise StoreMismatchError(f"data.train has {n_new} rows, {where} holds {n_old}: rows were appended, but the "
                                 f"store's features are whitened by a {old['curvature'].get('kind')} curvature fitted "
                                 "over all its train rows, which new rows change, and with it every stored feature; "
                                 "rerun with --overwrite to refit the curvature and featurize every row "
                                 "(curvature.kind: gram stores grow by featurizing the new rows only)")
    have = jsonable(prefix(n_old))
    if have != old["train_data"]:
        raise StoreMismatchError(
            f"data.train has {n_new} rows and {where} holds {n_old}, but the data's first {n_old} rows are not the "
            f"rows the store was featurized with (sha256 {str(have.get('sha256'))[:12]}, the store's "
            f"{str(old['train_data'].get('sha256'))[:12]}): a row was changed, removed or reordered. Only rows added "
            "after the featurized ones are appended: restore the old rows and put new documents after them, or ",
            fix=Fix("start_over", store=str(store.path)),
        )
    try:
        for m in store.model_ids():
            _grow_train(store, m, n_old, n_new, layout.chunk_rows)
        _mark_stale(store, {"n_train": n_old, "sha256": old["train_data"].get("sha256")})
        appends = list(attrs.get(APPENDS_ATTR) or [])
        appends.append({"n_train_before": n_old, "n_train": n_new,
                        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        attrs.update({"identity": jsonable(identity), LAYOUT_ATTR: layout.to_attrs(), APPENDS_ATTR: appends})
    except OSError as e:
        raise StoreError(f"growing {where} from {n_old} to {n_new} train rows failed: {e}; nothing computed is lost: "
                         "fix the cause and rerun the same command to finish the append") from None
    note = (f"appending {n_new - n_old} train rows to the {n_old} of {where}: only the new rows are featurized; "
            "the kernels are remade from the stored features")
    if _experiments(store):
        note = Note(note + "; scored experiments are stale until rescored (", Fix("rescore_call", str(store.path)), ")")
    store.notes.append(note)
    return True


def _experiments(store: "Store") -> list[str]:
    scores = node(store.root, "scores")
    return keys(scores) if scores is not None else []


def _grow_train(store: "Store", model_id: int, n_old: int, n_new: int, chunk_rows: int) -> None:
    """Steps 1-3 of the module docstring for ``train/<model_id>`` (each may already be done)."""
    path = f"train/{model_id}"
    group = node(store.root, path)
    done = node(group, "done")
    if done is None:  # nothing computed yet: `Store.train` creates the arrays at the new size
        return
    drop_all_done(done)  # before a flag is cleared or the flags grow
    for chunk in kept_rows(store, model_id):
        if chunk < done.shape[0] and read_entry(done, chunk):
            del group.attrs[KEPT_ATTR]  # an earlier append's chunk, finished since
    partial = n_old % chunk_rows
    if partial and done.shape[0] == -(-n_old // chunk_rows):  # not resized yet: the old last chunk is partly filled
        chunk = n_old // chunk_rows
        if read_entry(done, chunk):
            done[chunk] = 0  # first: a kill after it recomputes the whole chunk, never trusts unwritten rows
            group.attrs.update({KEPT_ATTR: {"chunk": chunk, "kept_rows": partial}})
    if node(group, "kernel") is not None:
        save_gram_prefix(store, model_id, n_old)  # the old rows' Gram, from the kernel: only new rows are added
        delete(store.root, f"{path}/kernel", metadata_only=False)
    n_chunks = -(-n_new // chunk_rows)
    for name in ("features", "out_to_loss", "nonfinite", *CODE_ARRAYS):  # codes: int8 / binary stores
        arr = node(group, name)
        if arr is not None and arr.shape[0] != n_new:
            writable(arr).resize((n_new, *arr.shape[1:]))
    progress = node(group, "rows_done")  # partial-chunk counts (trakcli.store.rows): one per chunk, like done
    if progress is not None and progress.shape[0] != n_chunks:
        progress.resize((n_chunks,))
    if done.shape[0] != n_chunks:
        done.resize((n_chunks,))


def _mark_stale(store: "Store", scored_over: dict[str, Any]) -> None:
    """Step 4: every experiment's scores record the rows they were scored over (the earliest, if grown twice)."""
    for exp in _experiments(store):
        group = node(store.root, f"scores/{exp}")
        if group is not None and STALE_ATTR not in group.attrs:
            group.attrs.update({STALE_ATTR: scored_over})


def kept_rows(store: "Store", model_id: int) -> dict[int, int]:
    """``{chunk: rows}``: the leading rows of a pending chunk of ``train/<model_id>`` kept by an append (``{}`` if
    none); featurize computes only the chunk's other rows if these read back intact
    (:func:`trakcli.jobs.featurize.featurize_rows`)."""
    group = node(store.root, f"train/{model_id}")
    kept = group.attrs.get(KEPT_ATTR) if group is not None else None
    if not (isinstance(kept, dict) and isinstance(kept.get("chunk"), int) and isinstance(kept.get("kept_rows"), int)):
        return {}
    return {kept["chunk"]: kept["kept_rows"]}


def stale_error(store: "Store", experiment: str) -> StoreStaleError | None:
    """The error for reading or rescoring the stale scores of ``experiment`` (its fix: ``Fix("rescore")``);
    None if they are not stale."""
    group = node(store.root, f"scores/{experiment}")
    stale = group.attrs.get(STALE_ATTR) if group is not None else None
    if not isinstance(stale, dict):
        return None
    n_now = store.layout.n_train
    return StoreStaleError(f"the scores of experiment {experiment!r} in {store.path} are stale: they were computed "
                           f"over {stale.get('n_train')} train rows, and the store now holds {n_now} (rows were "
                           "appended); ", fix=Fix("rescore", store=str(store.path)),
                           after=" (the target features are kept)")

