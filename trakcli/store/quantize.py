"""Compressed train features: int8 codes with a per-row scale, and 1-bit (sign) codes, beside a bfloat16 copy.

A store whose ``store.dtype`` is ``int8`` or ``binary`` keeps three arrays per checkpoint under
``train/<model_id>/``, written in the same chunk under the same ``done`` flag
(:meth:`trakcli.store.rows.ChunkedRows.write` derives the codes from the features):

* ``features`` ``[n_train, proj_dim]``: the float copy, stored as bfloat16 and read back as float32; whatever
  needs float features (kernel, full scores, the exact re-ranking, ``trak export``) reads it.
* ``codes``: ``int8`` ``[n_train, proj_dim]`` (``int8``) or ``uint8``
  ``[n_train, ceil(proj_dim / 8)]`` sign bits packed big-endian along the row
  (``binary``, numpy's :func:`numpy.packbits`: bit 1 where the feature is > 0).
* ``scale`` ``[n_train]`` float32: per row, ``max|φ| / 127`` (int8; the decoded
  row is ``codes · scale``) or ``mean|φ|`` (binary; the decoded row is
  ``(2·bits − 1) · scale``, the scale that minimizes the squared error of a
  sign code, Rastegari et al. 2016, "XNOR-Net", Eq. 4).
* The float copy and the codes are written uncompressed, whatever ``store.compressor``: the one-pass
  scan reads them straight from their chunk files (:mod:`trakcli.store.chunkread`) with no decompression
  beside its products. (Stores of an earlier layout may hold a compressed float copy and a
  ``features_crc32c`` array of per-row checksums: the float copy is read through zarr, the checksums are
  not read.)

The codes feed the candidate stage of the two-stage top-k (:mod:`trakcli.topk`); target features of such a
store are bfloat16 (no codes). Error bounds (tested): an int8 row decodes within ``scale / 2 = max|φ| / 254``
of each entry; a binary row keeps every entry's sign (0 decodes as ``−scale``). Imports neither zarr nor torch.
"""

from __future__ import annotations

import numpy as np

from trakcli.errors import StoreError

INT8 = "int8"
BINARY = "binary"
QUANTIZED = (INT8, BINARY)
"""``store.dtype`` values that keep codes beside a bfloat16 copy."""

FLOAT_COPY = "bfloat16"
"""The dtype of the float copy kept beside the codes."""

INT8_MAX = 127


def is_quantized(dtype: str) -> bool:
    """Whether ``store.dtype`` ``dtype`` keeps codes (``int8``, ``binary``)."""
    return dtype in QUANTIZED


def feature_dtype(dtype: str) -> str:
    """The dtype of the ``features`` arrays of a store of ``store.dtype`` ``dtype`` (the float copy: bfloat16)."""
    return FLOAT_COPY if is_quantized(dtype) else dtype


CODE_ARRAYS = ("codes", "scale")
"""The train arrays a store of a quantized dtype has beside ``features``, ``out_to_loss`` and ``nonfinite``."""


def code_arrays(dtype: str, n_rows: int, proj_dim: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """The extra arrays ``{name: (shape, zarr dtype)}`` of a store of ``store.dtype`` ``dtype`` ({} if none):
    the codes and their scales."""
    if not is_quantized(dtype):
        return {}
    if dtype == INT8:
        return {"codes": ((n_rows, proj_dim), "int8"), "scale": ((n_rows,), "float32")}
    return {"codes": ((n_rows, -(-proj_dim // 8)), "uint8"), "scale": ((n_rows,), "float32")}  # bytes of bits


def encode(dtype: str, x: np.ndarray) -> dict[str, np.ndarray]:
    """``{"codes": [rows, proj_dim] int8 | [rows, ceil(proj_dim/8)] uint8, "scale": [rows] float32}`` of the
    ``[rows, proj_dim]`` float features ``x`` for ``dtype`` ``int8`` or ``binary`` (else StoreError, as for an
    ``x`` that is not a 2-D float array). Non-finite entries are coded as 0 (int8) or as their sign (binary),
    with a scale taken over the finite entries."""
    x = np.asarray(x)
    if x.ndim != 2 or x.dtype.kind != "f":
        raise StoreError(f"features to compress must be a 2-D floating-point array [rows, proj_dim], got shape "
                         f"{list(x.shape)} and dtype {x.dtype}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    finite = np.where(np.isfinite(x), x, np.float32(0))
    if dtype == INT8:
        scale = (np.abs(finite).max(axis=1) / INT8_MAX).astype(np.float32)  # [rows]
        safe = np.where(scale > 0, scale, np.float32(1))
        codes = np.clip(np.rint(finite / safe[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
        return {"codes": codes, "scale": scale}
    if dtype == BINARY:
        scale = np.abs(finite).mean(axis=1, dtype=np.float64).astype(np.float32)
        return {"codes": np.packbits(x > 0, axis=1), "scale": scale}
    raise StoreError(f"no codes for store.dtype {dtype!r}; choose one of {', '.join(QUANTIZED)}")


def decode(dtype: str, codes: np.ndarray, scale: np.ndarray, proj_dim: int) -> np.ndarray:
    """The ``[rows, proj_dim]`` float32 features the codes (as :func:`encode` gives them) and ``[rows]`` scales stand
    for: ``codes · scale`` (int8) or ``(2·bit − 1) · scale`` (binary); StoreError for another ``dtype``."""
    return signs(dtype, codes, proj_dim).astype(np.float32) * np.asarray(scale, np.float32)[:, None]


def signs(dtype: str, codes: np.ndarray, proj_dim: int) -> np.ndarray:
    """The integer part of the codes as ``[rows, proj_dim]`` int8: the codes themselves (int8) or ±1 (binary);
    StoreError for another ``dtype``."""
    if dtype == INT8:
        return np.asarray(codes, np.int8)
    if dtype == BINARY:
        bits = np.unpackbits(np.asarray(codes, np.uint8), axis=1, count=proj_dim).view(np.int8)
        return bits * np.int8(2) - np.int8(1)
    raise StoreError(f"no codes for store.dtype {dtype!r}; choose one of {', '.join(QUANTIZED)}")
