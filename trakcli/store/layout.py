"""What a store is made with, told by its caller: the run identity, compared key by key, and the layout.

Every identity check of trakcli (the store's root, an experiment's targets and scores, the ``eval/`` group, score's
check of the train features, and `trak optimize`'s comparison with an earlier manifest) compares plain dicts
through :func:`flatten`, :func:`jsonable` and :func:`diff_keys`, so a mismatch is reported the same way everywhere:
one line per differing leaf, ``key: store has X, this run has Y``.

The store reads no shapes out of the run identity (the caller's dict): featurize gives a :class:`StoreLayout`,
which :meth:`Store.create_or_check <trakcli.store.store.Store.create_or_check>` records in the root attribute
``layout`` for every later read (as MadryLab trak's saver is given ``train_set_size`` and ``proj_dim``).
Imports neither zarr nor torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from trakcli.errors import Fix, StoreError, StoreMismatchError

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
        StoreError: a count is not a positive int, or an unknown dtype or compressor (names the value and the choices).
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
            raise StoreError(f"store {where}: its root attribute {LAYOUT_ATTR!r} is damaged ({e}); rerun "
                             "`trak featurize CONFIG --overwrite` to rebuild the store") from None


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts (and lists of dicts, keyed by index: ``projector.layers.3.k_in``) as one flat dict with dotted
    keys below ``prefix``; anything else is a leaf: ``{"projector.proj_dim": 16}``, or ``{prefix: d}``."""
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(d, list) and d and all(isinstance(v, dict) for v in d):
        out = {f"{prefix}.#": len(d)}
        for i, v in enumerate(d):
            out.update(flatten(v, f"{prefix}.{i}"))
        return out
    return {prefix: d}


def jsonable(d: Any) -> Any:
    """``d`` round-tripped through JSON (what zarr attributes hold)."""
    return json.loads(json.dumps(d, default=str))


_UNSET = object()


def _leaves(old: dict[str, Any], new: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Flattened :func:`jsonable` ``old`` and ``new``, and their differing keys (sorted)."""
    a, b = flatten(jsonable(old)), flatten(jsonable(new))
    return a, b, [k for k in sorted(set(a) | set(b)) if a.get(k, _UNSET) != b.get(k, _UNSET)]


def differing_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The dotted keys whose leaves differ between ``old`` and ``new`` (sorted), both :func:`jsonable` and
    :func:`flatten`; a key present on one side only differs (even if the other side's value is None)."""
    return _leaves(old, new)[2]


def diff_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable lines ``key: store has X, this run has Y`` for the :func:`differing_keys`."""
    a, b, keys = _leaves(old, new)
    show = lambda v: "<unset>" if v is _UNSET else repr(v)  # noqa: E731
    return [f"{k}: store has {show(a.get(k, _UNSET))}, this run has {show(b.get(k, _UNSET))}" for k in keys]


#: The config key that sets a store identity key, named beside a differing key (prefix -> key).
CONFIG_KEYS = {
    "train_data.input_shape.": "data.train.max_length for text data, else the train inputs' shape",
    "train_data.max_length": "data.train.max_length",
}


def settings_mismatch(what: str, old: dict[str, Any] | None, new: dict[str, Any], fix: str | Fix) -> StoreMismatchError:
    """The error for stored data made with other settings: ``what`` differs, key by key (with the config key that
    sets it, where known: :data:`CONFIG_KEYS`), and ``fix`` (a sentence, or a :class:`~trakcli.errors.Fix`
    each front end words)."""
    lines = [line + next((f" (set by {config_key})" for prefix, config_key in CONFIG_KEYS.items()
                          if line.split(":", 1)[0].startswith(prefix)), "")
             for line in diff_keys(old or {}, new)] or ["(identity differs)"]
    was = flatten(old or {})
    after = ""
    if any(was.get(k) == "rademacher" and v == "sjlt" for k, v in flatten(jsonable(new)).items() if k.endswith("kind")):
        after = (" (sjlt became the default projector kind; it was rademacher: "
                 "set projector.kind: rademacher to go on with this store)")
    return mismatch(f"{what} were made with different settings:\n  " + "\n  ".join(lines) + "\n", fix, after)


def mismatch(head: str, fix: str | Fix, after: str = "") -> StoreMismatchError:
    """A :class:`StoreMismatchError` saying ``head``, ``fix`` (a sentence, or a :class:`Fix`), then ``after``."""
    if isinstance(fix, Fix):
        return StoreMismatchError(head, fix=fix, after=after)
    return StoreMismatchError(head + fix + after)


def check_same(what: str, old: Any, new: Any, fix: str | Fix) -> None:
    """Refuse (:func:`settings_mismatch`) a run whose settings ``new`` (compared after :func:`jsonable`) differ from
    the recorded ``old`` (None if none were recorded) that ``what`` was made with, naming ``fix``."""
    new = jsonable(new)
    if old != new:
        raise settings_mismatch(what, old, new, fix)
