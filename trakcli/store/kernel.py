"""The per-checkpoint kernel ``train/<model_id>/kernel``: what `trak score` needs of the train side.

Its attribute ``form`` says which (:mod:`trakcli.scoring`): ``cholesky_lower``, the ``[proj_dim, proj_dim]`` float64
lower Cholesky factor of ``ΦᵀΦ + λI``; or ``dual_solved_features``, the ``[n_train, proj_dim]`` float32
``(ΦΦᵀ + λI)⁻¹Φ`` (when ``n_train < proj_dim``). It is derived data: written by ``trak featurize`` or ``trak score``
(its attributes ``lambda_reg`` and ``settings`` last, as the done marker), verified on every read, and rebuilt by
``trak score`` when corrupt, missing or unreadable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from trakcli.errors import StoreError
from trakcli.store.integrity import StoreCorruptError, attrs_of, delete, node, writable
from trakcli.store.layout import jsonable
from trakcli.store.rows import codecs, read_checked

if TYPE_CHECKING:
    from trakcli.store.store import Store


def write_array(group: Any, name: str, a: np.ndarray, chunks: tuple[int, ...] | None = None,
                dims: tuple[str, ...] | None = None, reuse: bool = False) -> Any:
    """Write ``a`` as the array ``name`` of ``group`` (uncompressed: float64 factors barely compress; one chunk
    unless ``chunks``; checksummed) and return it. ``reuse``: into the array there when it has the same shape and
    dtype (its attributes, a done marker, cleared first), else into a new one."""
    arr = node(group, name)
    if arr is not None and not (reuse and hasattr(arr, "shape") and tuple(arr.shape) == a.shape
                                and np.dtype(arr.dtype) == a.dtype):
        delete(group, name, metadata_only=False)
        arr = None
    if arr is None:
        arr = group.create_array(name, shape=a.shape, chunks=chunks or a.shape or None, dtype=a.dtype.name,
                                 fill_value=0, compressors=codecs("none"), dimension_names=dims)
    elif arr.attrs:
        arr.attrs.clear()
    writable(arr)[...] = a
    return arr


def train_group(store: "Store", model_id: int) -> Any:
    """The group ``train/<model_id>``; StoreError naming `trak featurize` if it is missing."""
    group = node(store.root, f"train/{model_id}")
    if group is None:
        raise StoreError(f"store group train/{model_id} is missing; run `trak featurize CONFIG` first")
    return group


def read_kernel(store: "Store", model_id: int, settings: dict[str, Any],
                rebuild: bool = False) -> tuple[np.ndarray, float] | None:
    """The stored kernel of checkpoint ``model_id`` (float64 factor or float32 solved features, as written) and λ if
    made with the ridge ``settings``; None if there is none, or it was made with other settings. A corrupt or missing
    kernel chunk, or unreadable kernel metadata, raises StoreCorruptError (naming ``trak score CONFIG``), or with
    ``rebuild`` deletes the kernel (noted in ``store.notes``) and returns None."""
    path = f"train/{model_id}/kernel"
    try:
        arr = node(store.root, path)
        if arr is None or not kernel_attrs_done(arr.attrs, settings):
            return None
        return read_checked(arr, slice(None), 0), float(arr.attrs["lambda_reg"])
    except StoreCorruptError as e:
        if not rebuild or e.array != path:
            raise
        delete(store.root, path, metadata_only=False)
        store.notes.append(f"model_id {model_id}: the stored kernel was corrupt or missing; it is rebuilt")
        return None


#: Bytes per chunk of a kernel array (whole rows; a smaller kernel is one chunk).
KERNEL_CHUNK_BYTES = 64 << 20


def kernel_attrs_done(attrs: Any, settings: dict[str, Any]) -> bool:
    """Whether kernel attributes mark a kernel finished with ``settings`` (the one test of a finished kernel)."""
    return attrs.get("settings") == jsonable(settings) and "lambda_reg" in attrs


def write_kernel(store: "Store", model_id: int, factor: np.ndarray, settings: dict[str, Any], lambda_reg: float,
                 form: str = "cholesky_lower") -> None:
    """Write the kernel, then its attributes (the done marker).

    Args:
        factor: 2-D, float64 or float32: ``[proj_dim, proj_dim]`` float64 (form ``cholesky_lower``, the factor of
            ``ΦᵀΦ + λI``) or ``[n_train, proj_dim]`` float32 (form ``dual_solved_features``, ``(ΦΦᵀ + λI)⁻¹Φ``:
            :mod:`trakcli.scoring`). Chunked by whole rows of about :data:`KERNEL_CHUNK_BYTES`.
        form: recorded in the attributes (``form``).

    Raises:
        StoreError: the write failed (rerun to resume), or the checkpoint's group is missing.
    """
    group = train_group(store, model_id)
    rows = max(1, min(factor.shape[0], KERNEL_CHUNK_BYTES // max(1, factor.shape[1] * factor.itemsize)))
    try:
        arr = write_array(group, "kernel", np.ascontiguousarray(factor), (rows, factor.shape[1]),
                          ("kernel_row", "kernel_col"), reuse=True)
        arr.attrs.update({"form": form, "lambda_reg": lambda_reg, "settings": jsonable(settings)})
    except OSError as e:
        raise StoreError(f"writing the kernel of model_id {model_id} failed: {e}; rerun to resume") from None


def kernel_done(store: "Store", model_id: int, settings: dict[str, Any]) -> bool:
    """Whether ``train/<model_id>/kernel`` was finished with ``settings`` (its attributes only; no chunk is read):
    the cheap check of `trak featurize` on a finished store (`trak score` verifies it: :func:`read_kernel`)."""
    return kernel_attrs_done(attrs_of(store.root, f"train/{model_id}/kernel") or {}, settings)


def kernel_nbytes(store: "Store", model_id: int) -> int:
    """Bytes of ``train/<model_id>/kernel`` by its metadata (shape x dtype); 0 if absent or unreadable."""
    try:
        arr = node(store.root, f"train/{model_id}/kernel")
    except StoreCorruptError:
        return 0
    return int(np.prod(arr.shape)) * arr.dtype.itemsize if arr is not None else 0


#: Array beside a kernel while train rows are appended: the Gram ``ΦᵀΦ`` of the rows featurized before.
GRAM_PREFIX = "gram_prefix"


def save_gram_prefix(store: "Store", model_id: int, n_rows: int) -> bool:
    """Keep the Gram ``ΦᵀΦ`` of the first ``n_rows`` train rows (the store's before an append), before the kernel is
    dropped, so that the grown kernel adds only the new rows' products (:func:`read_gram_prefix`). Recovered from the
    stored primal kernel ``L`` (the lower Cholesky factor of ``ΦᵀΦ + λI``) as ``L Lᵀ − λI`` in float64 and written as
    ``train/<model_id>/gram_prefix`` ``[proj_dim, proj_dim]`` float64, its attribute ``n_rows`` last (the done marker).
    An already kept prefix is left as it is. Returns whether a prefix is kept (False without a finished primal kernel);
    raises OSError when the write fails."""
    if read_gram_prefix(store, model_id) is not None:
        return True
    arr = node(store.root, f"train/{model_id}/kernel")
    attrs = dict(arr.attrs) if arr is not None else {}
    if attrs.get("form") != "cholesky_lower" or "lambda_reg" not in attrs:
        return False
    try:
        factor = read_checked(arr, slice(None), 0)
    except StoreCorruptError:
        return False
    gram = factor @ factor.T
    gram[np.diag_indices_from(gram)] -= float(attrs["lambda_reg"])
    out = write_array(node(store.root, f"train/{model_id}"), GRAM_PREFIX, gram.astype(np.float64, copy=False),
                      dims=("proj_row", "proj_col"))
    out.attrs.update({"n_rows": int(n_rows)})
    return True


def read_gram_prefix(store: "Store", model_id: int) -> tuple[np.ndarray, int] | None:
    """The kept ``([proj_dim, proj_dim] float64 Gram, n_rows)`` of :func:`save_gram_prefix`, checksums verified;
    None if there is none, it is unfinished, or it is corrupt (then it is deleted)."""
    path = f"train/{model_id}/{GRAM_PREFIX}"
    try:
        arr = node(store.root, path)
        n = arr.attrs.get("n_rows") if arr is not None else None
        if not isinstance(n, int) or n < 1:
            return None
        return read_checked(arr, slice(None), 0), n
    except StoreCorruptError:
        delete(store.root, path, metadata_only=False)
        return None


def drop_gram_prefix(store: "Store", model_id: int) -> None:
    """Delete ``train/<model_id>/gram_prefix`` (once the grown kernel is written), if there is one."""
    delete(store.root, f"train/{model_id}/{GRAM_PREFIX}", metadata_only=False)
