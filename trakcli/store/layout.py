"""The shapes and storage of a store's feature and score arrays, told to the store by its caller.

The store does not read shapes out of the run identity (a dict whose keys
belong to the caller): featurize tells it ``n_train``, ``proj_dim`` and the
storage settings as a :class:`StoreLayout`, which :meth:`Store.create_or_check
<trakcli.store.store.Store.create_or_check>` records in the root attribute
``layout`` and every later read uses (as MadryLab trak's saver is given
``train_set_size`` and ``proj_dim``).

Imports neither zarr nor torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from trakcli.errors import StoreError

STORAGE_DTYPES = ("float32", "float16", "bfloat16")
COMPRESSORS = ("zstd", "blosc", "none")

#: Kernel forms an earlier trakcli stored that this one no longer uses: such a kernel counts as
#: missing and is made again (``dual_cholesky_lower``, the ``[n_train, n_train]`` factor that
#: `trak score` applied to every target set, replaced by the solved features of
#: :func:`trakcli.scoring.dual_solved_features`).
STALE_KERNEL_FORMS = frozenset({"dual_cholesky_lower"})

LAYOUT_ATTR = "layout"
"""The root attribute holding the :class:`StoreLayout` (stores written before it have none)."""


@dataclass(frozen=True)
class StoreLayout:
    """How the train features, target features and scores of a store are shaped and stored.

    Attributes:
        n_train: rows of the train features ``[n_train, proj_dim]`` and columns
            of the scores ``[n_target, n_train]``.
        proj_dim: columns of the train and target features.
        chunk_rows: rows per chunk of the features (and train columns per chunk of the scores).
        dtype: storage dtype of the train and target features, one of :data:`STORAGE_DTYPES`
            (``bfloat16`` is stored as ``uint16`` bits and read back as float32:
            :mod:`trakcli.store.bfloat16`).
        compressor: codec of the feature and score chunks, one of :data:`COMPRESSORS`
            (each chunk also carries a CRC32C checksum).

    Raises:
        StoreError: a count is not a positive int, or an unknown dtype or compressor
            (names the value and the choices).
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
        """The layout recorded by :meth:`to_attrs`.

        Args:
            attrs: the recorded dict.
            where: the store path (for the message).

        Raises:
            StoreError: the record is damaged (missing keys or invalid values).
        """
        try:
            return cls(**{k: attrs[k] for k in ("n_train", "proj_dim", "chunk_rows", "dtype", "compressor")})
        except (KeyError, TypeError, StoreError) as e:
            raise StoreError(
                f"store {where}: its root attribute {LAYOUT_ATTR!r} is damaged ({e}); rerun `trak featurize CONFIG "
                "--overwrite` to rebuild the store"
            ) from None

    @classmethod
    def from_legacy_identity(cls, identity: dict[str, Any], where: str) -> "StoreLayout":
        """The layout of a store written before the ``layout`` attribute, read from its recorded identity.

        Those stores recorded ``train_data.n``, ``projector.proj_dim`` and
        ``storage`` (chunk_rows, dtype, compressor) in their ``identity``
        attribute; this is the only place the store reads them there.

        Raises:
            StoreError: the identity lacks them (names the store and the fix).
        """
        try:
            storage = identity["storage"]
            return cls(
                n_train=identity["train_data"]["n"],
                proj_dim=identity["projector"]["proj_dim"],
                chunk_rows=storage["chunk_rows"],
                dtype=storage["dtype"],
                compressor=storage["compressor"],
            )
        except (KeyError, TypeError, StoreError):
            raise StoreError(
                f"store {where} records no array layout (no {LAYOUT_ATTR!r} attribute); run "
                "`trak featurize CONFIG` to record it, or `trak featurize CONFIG --overwrite` to rebuild the store"
            ) from None
