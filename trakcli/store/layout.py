"""The shapes and storage of a store's feature and score arrays, told to the store by its caller.

The store reads no shapes out of the run identity (the caller's dict): featurize gives a :class:`StoreLayout`,
which :meth:`Store.create_or_check <trakcli.store.store.Store.create_or_check>` records in the root attribute
``layout`` for every later read (as MadryLab trak's saver is given ``train_set_size`` and ``proj_dim``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from trakcli.errors import StoreError

STORAGE_DTYPES = ("float32", "float16", "bfloat16", "int8", "binary")
COMPRESSORS = ("zstd", "blosc", "none")

LAYOUT_ATTR = "layout"
"""The root attribute holding the :class:`StoreLayout`."""


@dataclass(frozen=True)
class StoreLayout:
    """How the train features, target features and scores of a store are shaped and stored.

    Attributes:
        n_train: rows of the train features ``[n_train, proj_dim]`` and columns of the scores ``[n_target, n_train]``.
        proj_dim: columns of the train and target features.
        chunk_rows: rows per chunk of the features (and train columns per chunk of the scores).
        dtype: storage dtype of the train and target features, one of :data:`STORAGE_DTYPES` (``bfloat16`` as
            ``uint16`` bits read back as float32; ``int8`` and ``binary``: codes beside a bfloat16 copy).
        compressor: codec of the feature and score chunks, one of :data:`COMPRESSORS` (plus a CRC32C checksum).

    Raises:
        StoreError: a count is not a positive int, or an unknown dtype or compressor (names the value and the
            choices).
    """

    n_train: int
    proj_dim: int
    chunk_rows: int
    dtype: str = "float32"
    compressor: str = "zstd"

    def __post_init__(self) -> None:
        for name in ("n_train", "proj_dim", "chunk_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StoreError(f"store layout: {name} must be a positive integer, got {value!r}")
        if self.dtype not in STORAGE_DTYPES:
            raise StoreError(f"store layout: dtype {self.dtype!r} is not one of {', '.join(STORAGE_DTYPES)}")
        if self.compressor not in COMPRESSORS:
            raise StoreError(f"store layout: compressor {self.compressor!r} is not one of {', '.join(COMPRESSORS)}")

    def to_attrs(self) -> dict[str, Any]:
        """The layout as the plain dict recorded in the root attribute ``layout``."""
        return asdict(self)

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any], where: str) -> "StoreLayout":
        """The layout recorded by :meth:`to_attrs` in the store at ``where``; StoreError if the record is damaged."""
        try:
            return cls(**{k: attrs[k] for k in ("n_train", "proj_dim", "chunk_rows", "dtype", "compressor")})
        except (KeyError, TypeError, StoreError) as e:
            raise StoreError(
                f"store {where}: its root attribute {LAYOUT_ATTR!r} is damaged ({e}); rerun `trak featurize CONFIG "
                "--overwrite` to rebuild the store"
            ) from None
