"""bfloat16 feature storage: float32 values kept as the upper 16 bits of their float32 encoding.

A store whose ``store.dtype`` is ``bfloat16`` keeps its feature arrays as Zarr
``uint16`` arrays of bfloat16 bit patterns, and records the logical dtype in
each such array's attributes (``{"logical_dtype": "bfloat16", "encoding": ...}``).
The store converts on the way in (:meth:`ChunkedRows.write
<trakcli.store.rows.ChunkedRows.write>`: float32 → bits) and on the way out
(:func:`trakcli.store.rows.read_checked`: bits → float32), so every reader of
the store (featurize's resume, the kernels, score, ``trak inspect``, ``trak
export``) sees ``float32`` numpy arrays whose values are bfloat16 numbers.

Why bits and not a bfloat16 Zarr data type: zarr-python 3.1 has no bfloat16
data type. One can be registered as a Zarr v3 data type extension on top of
the ``ml_dtypes`` package, but then every reader of the store needs that same
extension: plain zarr, xarray, or a Zarr library in another language would
refuse to open the array at all. A ``uint16`` array opens everywhere, and its
attributes say how to decode it: ``(bits.astype(uint32) << 16).view(float32)``.

The rounding is the one ``torch.Tensor.to(torch.bfloat16)`` does: round to
nearest, ties to even, on the float32 bits; subnormals are kept (not flushed),
finite values past the largest bfloat16 become ±inf, ±inf stay ±inf, and NaN
stays NaN (its sign kept, the quiet bit set; torch's own NaN bit patterns
differ between its scalar and vectorized paths, so only NaN-ness is promised).

Imports neither zarr nor torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trakcli.errors import StoreError

BFLOAT16 = "bfloat16"
LOGICAL_DTYPE_ATTR = "logical_dtype"
"""The array attribute naming the dtype that a ``uint16`` array's bits encode."""

ENCODING = (
    "upper 16 bits of the float32 encoding, rounded to nearest even; decode: (bits.astype(uint32) << 16).view(float32)"
)
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
    """bfloat16 bit patterns of ``x``, rounded to nearest even.

    Args:
        x: any shape, a real floating dtype (float16 and float64 are cast to
            float32 first).

    Returns:
        ``uint16`` array of ``x``'s shape.

    Raises:
        StoreError: ``x`` is not a real floating-point array.
    """
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
    """The float32 values of bfloat16 bit patterns (exact: every bfloat16 is a float32).

    Args:
        bits: ``uint16`` array, any shape.

    Returns:
        ``float32`` array of the same shape.

    Raises:
        StoreError: ``bits`` is not ``uint16``.
    """
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise StoreError(f"bfloat16 bits must be uint16, got dtype {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to the nearest bfloat16, as float32 (what a bfloat16 store reads back).

    Args:
        x: any shape, a real floating dtype.

    Returns:
        ``float32`` array of ``x``'s shape.
    """
    return from_bits(to_bits(x))
