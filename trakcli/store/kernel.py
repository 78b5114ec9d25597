"""The per-checkpoint kernel ``train/<model_id>/kernel``: what `trak score` needs of the train side.

Its attribute ``form`` says which (:mod:`trakcli.scoring`): ``cholesky_lower``,
the ``[proj_dim, proj_dim]`` float64 lower Cholesky factor of ``ΦᵀΦ + λI``; or
``dual_solved_features``, the ``[n_train, proj_dim]`` float32 ``(ΦΦᵀ + λI)⁻¹Φ``
(when ``n_train < proj_dim``). It is derived data: written by ``trak
featurize`` or ``trak score`` (its attributes ``lambda_reg`` and ``settings``
last, as the done marker), verified on every read, and rebuilt by ``trak
score`` when corrupt, missing or unreadable.
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


def read_kernel(
    store: "Store", model_id: int, settings: dict[str, Any], rebuild: bool = False
) -> tuple[np.ndarray, float] | None:
    """The stored kernel (float64 factor or float32 solved features, as written) and λ if made with ``settings``.

    None if there is none, or it was made with other settings.

    Args:
        store: the open store.
        model_id: the checkpoint.
        settings: the ridge settings the kernel must have been made with.
        rebuild: a corrupt or missing kernel chunk, or unreadable kernel
            metadata, deletes the kernel (noted in ``store.notes``) and returns
            None, so that the caller computes it again (``trak score``).

    Raises:
        StoreCorruptError: the kernel is corrupt (without ``rebuild``); names ``trak score CONFIG``.
    """
    path = f"train/{model_id}/kernel"
    try:
        arr = node(store.root, path)
        if arr is None:
            return None
        attrs = dict(arr.attrs)
        if not kernel_attrs_done(attrs, settings):
            return None
        return read_checked(arr, slice(None), 0), float(attrs["lambda_reg"])
    except StoreCorruptError as e:
        if not rebuild or e.array != path:
            raise
        delete(store.root, path, metadata_only=False)
        store.notes.append(f"model_id {model_id}: the stored kernel was corrupt or missing; it is rebuilt")
        return None


#: Bytes per chunk of a kernel array (whole rows; a smaller kernel is one chunk).
KERNEL_CHUNK_BYTES = 64 << 20


def kernel_attrs_done(attrs: dict[str, Any], settings: dict[str, Any]) -> bool:
    """Whether kernel attributes mark a kernel finished with ``settings``.

    The one test of a finished kernel: :func:`read_kernel`, :func:`kernel_done` and the zarr-free
    :func:`trakcli.store.finished.train_finished` all apply it.
    """
    return attrs.get("settings") == jsonable(settings) and "lambda_reg" in attrs


def write_kernel(
    store: "Store", model_id: int, factor: np.ndarray, settings: dict[str, Any], lambda_reg: float,
    form: str = "cholesky_lower",
) -> None:
    """Write the kernel, then its attributes (the done marker).

    Args:
        factor: 2-D, float64 or float32: ``[proj_dim, proj_dim]`` float64 (form ``cholesky_lower``,
            the factor of ``ΦᵀΦ + λI``) or ``[n_train, proj_dim]`` float32 (form
            ``dual_solved_features``, ``(ΦΦᵀ + λI)⁻¹Φ``: :mod:`trakcli.scoring`). Chunked by whole
            rows of about :data:`KERNEL_CHUNK_BYTES`.
        form: recorded in the attributes (``form``).

    Raises:
        StoreError: the write failed (rerun to resume), or the checkpoint's group is missing.
    """
    group = node(store.root, f"train/{model_id}")
    if group is None:
        raise StoreError(f"store group train/{model_id} is missing; run `trak featurize CONFIG` first")
    shape, dtype = tuple(factor.shape), str(factor.dtype)
    chunks = (max(1, min(shape[0], KERNEL_CHUNK_BYTES // max(1, shape[1] * factor.itemsize))), shape[1])
    try:
        arr = node(group, "kernel")
        if arr is not None and (tuple(arr.shape) != shape or str(arr.dtype) != dtype):  # a damaged one
            delete(store.root, f"train/{model_id}/kernel", metadata_only=False)
            arr = None
        if arr is not None:
            arr.attrs.clear()
        else:
            arr = group.create_array("kernel", shape=shape, chunks=chunks, dtype=dtype, fill_value=0,
                                     compressors=codecs("none"),  # float64 factors barely compress; zstd doubled the write
                                     dimension_names=("kernel_row", "kernel_col"))
        writable(arr)[:] = np.ascontiguousarray(factor)
        arr.attrs.update({"form": form, "lambda_reg": lambda_reg, "settings": jsonable(settings)})
    except OSError as e:
        raise StoreError(f"writing the kernel of model_id {model_id} failed: {e}; rerun to resume") from None


def kernel_done(store: "Store", model_id: int, settings: dict[str, Any]) -> bool:
    """Whether ``train/<model_id>/kernel`` was finished with ``settings`` (its attributes only; no chunk is read).

    The cheap check of `trak featurize` on a finished store; `trak score` reads
    and verifies the kernel itself (:func:`read_kernel`).
    """
    try:
        arr = node(store.root, f"train/{model_id}/kernel")
        if arr is None:
            return False
        attrs = dict(arr.attrs)
    except StoreCorruptError:
        return False
    return kernel_attrs_done(attrs, settings)


def kernel_nbytes(store: "Store", model_id: int) -> int:
    """Bytes of ``train/<model_id>/kernel`` by its metadata (shape x dtype); 0 if absent or unreadable."""
    try:
        arr = node(store.root, f"train/{model_id}/kernel")
    except StoreCorruptError:
        return 0
    return int(np.prod(arr.shape)) * arr.dtype.itemsize if arr is not None else 0
