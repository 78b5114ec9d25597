"""bfloat16 feature storage: float32 values kept as the upper 16 bits of their float32 encoding.

A store whose ``store.dtype`` is ``bfloat16`` keeps its feature arrays as Zarr ``uint16`` arrays of bfloat16
bit patterns, their attributes naming the logical dtype (``{"logical_dtype": "bfloat16", "encoding": ...}``).
:meth:`~trakcli.store.rows.ChunkedRows.write` converts float32 to bits and
:func:`~trakcli.store.rows.read_checked` bits to float32, so every reader sees float32 arrays. Bits, not a
bfloat16 Zarr data type: zarr 3.1 has none, and an extension type would make plain zarr, xarray and other
Zarr libraries refuse the array; a ``uint16`` array opens everywhere.

The rounding is ``torch.Tensor.to(torch.bfloat16)``'s: to nearest, ties to even; subnormals kept, finite
values past the largest bfloat16 become ±inf, NaN stays NaN (its sign kept, the quiet bit set; only
NaN-ness is promised, as torch's own NaN bit patterns vary). Imports neither zarr nor torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trakcli.errors import StoreError

BFLOAT16 = "bfloat16"
LOGICAL_DTYPE_ATTR = "logical_dtype"
"""The array attribute naming the dtype that a ``uint16`` array's bits encode."""

ENCODING = ("upper 16 bits of the float32 encoding, rounded to nearest even; "
            "decode: (bits.astype(uint32) << 16).view(float32)")
"""The array attribute ``encoding`` of bfloat16 features: how to read them without trakcli."""

BITS_DTYPE = "uint16"


def storage_dtype(dtype: str) -> str:
    """The Zarr data type of a feature array of ``store.dtype`` ``dtype`` (``bfloat16`` → ``uint16``)."""
    return BITS_DTYPE if dtype == BFLOAT16 else dtype


def array_attrs(dtype: str) -> dict[str, str] | None:
    """The attributes a feature array of ``store.dtype`` ``dtype`` is created with (None: none needed)."""
    return {LOGICAL_DTYPE_ATTR: BFLOAT16, "encoding": ENCODING} if dtype == BFLOAT16 else None


def is_bfloat16(arr: Any) -> bool:
    """Whether the zarr array ``arr`` holds bfloat16 bits (its attribute ``logical_dtype`` says so)."""
    return arr.attrs.get(LOGICAL_DTYPE_ATTR) == BFLOAT16


def logical_dtype(arr: Any) -> str:
    """The dtype a read of the zarr array ``arr`` returns: ``float32`` for bfloat16 bits, else its own."""
    return "float32" if is_bfloat16(arr) else str(np.dtype(arr.dtype))


def to_bits(x: np.ndarray) -> np.ndarray:
    """``uint16`` bfloat16 bit patterns of ``x`` (any shape, a real floating dtype, else StoreError; cast to float32
    first), rounded to nearest even."""
    x = np.asarray(x)
    if x.dtype.kind != "f":
        raise StoreError(f"bfloat16 storage takes floating-point features, got dtype {x.dtype}")
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # round to nearest even: add 0x7FFF plus the lowest kept bit, then truncate; finite values
    # past the largest bfloat16 carry into the exponent and become inf, as they should
    bits = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if nan.any():  # the rounding carry could turn a NaN into inf or flip its sign: keep sign, set the quiet bit
        bits[nan] = ((u[nan] >> 16) | 0x0040).astype(np.uint16)
    return bits


def from_bits(bits: np.ndarray) -> np.ndarray:
    """The float32 values (exact) of the ``uint16`` bfloat16 bit patterns ``bits`` (any shape; else StoreError)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise StoreError(f"bfloat16 bits must be uint16, got dtype {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """``x`` (any shape, a real floating dtype) rounded to the nearest bfloat16, as float32 (what a bfloat16 store
    reads back)."""
    return from_bits(to_bits(x))
