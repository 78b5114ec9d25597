"""Is a store's train featurization finished? Answered from its metadata files, without importing zarr.

A ``trak featurize`` rerun on a finished store has nothing to do, yet opening
the store through zarr costs more than the rest of the run (importing zarr
alone takes ~0.3 s). :func:`train_finished` reads the few small files that the
full check (:meth:`Store.create_or_check <trakcli.store.store.Store.create_or_check>`,
:meth:`Store.train <trakcli.store.store.Store.train>`, the ``done`` flags) reads:
the ``zarr.json`` of the root, of ``train`` and of each ``train/<model_id>`` and
its arrays (JSON documents, Zarr v3 spec: https://zarr-specs.readthedocs.io/en/latest/v3/core/index.html),
and the ``done`` chunk files.

It answers True only when everything is exactly as a finished run of this
version leaves it, and False whenever anything differs or cannot be read. True
means the full check would open the store, find the same identity, layout and
checkpoints, every array of the right shape, every ``done`` flag set and (if
asked) every kernel made with the run's ridge settings, and would change nothing. False is not an error: the caller then runs the full
check, which refuses, repairs, resumes, and words every message, as before.
So this module decides nothing the store does not already decide; it only
lets the common case skip zarr. It does not replace ``--verify``: a plain run
never reads the feature chunks.

Imports neither zarr nor torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from trakcli.store.bfloat16 import array_attrs, storage_dtype
from trakcli.store.evalgroup import eval_kept
from trakcli.store.identity import jsonable
from trakcli.store.kernel import kernel_attrs_done
from trakcli.store.layout import LAYOUT_ATTR, StoreLayout
from trakcli.store.location import is_remote, is_url
from trakcli.store.store import SCHEMA_VERSION

#: The file of a set ``done`` flag: the uint8 value 1, then its CRC32C checksum (little-endian),
#: as zarr writes it through the codecs ``[bytes, crc32c]`` (tests/jobs/test_featurize.py checks zarr's bytes).
DONE_CHUNK = b"\x01\x52\xd0\x16\xa0"

#: The metadata of a ``done`` array (one uint8 flag per chunk) besides its shape.
DONE_META = {
    "data_type": "uint8",
    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1]}},
    "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
    "fill_value": 0,
    "codecs": [{"name": "bytes"}, {"name": "crc32c"}],
}

#: Codecs this version writes in a data array (:func:`trakcli.store.rows.codecs`).
DATA_CODECS = {"bytes", "zstd", "blosc", "crc32c"}


def _meta(path: Path, node_type: str) -> dict[str, Any] | None:
    """The parsed ``zarr.json`` of a Zarr v3 node of ``node_type``, or None (missing, unreadable or another kind)."""
    try:
        meta = json.loads((path / "zarr.json").read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != node_type:
        return None
    if node_type == "group" and (not isinstance(meta.get("attributes", {}), dict) or meta.get("consolidated_metadata")):
        return None
    if node_type == "array" and meta.get("storage_transformers", []) != []:
        return None
    return meta


def _data_array(path: Path, shape: list[int], chunks: list[int], dtype: str) -> bool:
    """Whether ``path`` is an array of ``shape``, ``dtype`` and row ``chunks`` with this version's codecs.

    ``dtype`` is a ``store.dtype`` or a Zarr data type; bfloat16 is a ``uint16`` array
    with the attributes :func:`trakcli.store.bfloat16.array_attrs`.
    """
    meta = _meta(path, "array")
    if meta is None or meta.get("shape") != shape or meta.get("data_type") != storage_dtype(dtype):
        return False
    attrs = meta.get("attributes", {})
    if "fill_value" not in meta or not isinstance(attrs, dict):
        return False
    if any(attrs.get(k) != v for k, v in (array_attrs(dtype) or {}).items()):
        return False
    if meta.get("chunk_grid") != {"name": "regular", "configuration": {"chunk_shape": chunks}}:
        return False
    if meta.get("chunk_key_encoding") != DONE_META["chunk_key_encoding"]:
        return False
    codecs = meta.get("codecs")
    return (
        isinstance(codecs, list) and bool(codecs) and all(isinstance(c, dict) for c in codecs)
        and codecs[0].get("name") == "bytes" and all(c.get("name") in DATA_CODECS for c in codecs)
    )


def _kernel_done(path: Path, settings: dict[str, Any]) -> bool:
    """Whether ``path`` is a kernel finished with ``settings`` (attributes ``settings`` and ``lambda_reg``).

    The same test as :func:`trakcli.store.kernel.kernel_done` (attributes only, no chunk read),
    on an array whose metadata has the fields zarr needs.
    """
    meta = _meta(path, "array")
    if meta is None or any(k not in meta for k in ("shape", "data_type", "chunk_grid", "chunk_key_encoding",
                                                   "fill_value", "codecs")):
        return False
    attrs = meta.get("attributes", {})
    return isinstance(attrs, dict) and kernel_attrs_done(attrs, settings)


def _all_done(path: Path, n_chunks: int) -> bool:
    """Whether ``path`` is a ``done`` array of ``n_chunks`` flags, every one set and intact."""
    meta = _meta(path, "array")
    if meta is None or meta.get("shape") != [n_chunks] or any(meta.get(k) != v for k, v in DONE_META.items()):
        return False
    try:
        return all((path / "c" / str(c)).read_bytes() == DONE_CHUNK for c in range(n_chunks))
    except OSError:
        return False


def train_finished(
    path: str | Path,
    identity: dict[str, Any],
    layout: StoreLayout,
    shas: Sequence[str],
    kernel_settings: dict[str, Any] | None = None,
    state_shas: Sequence[str] | None = None,
) -> bool:
    """Whether the store at ``path`` holds the finished train features of this run, read without zarr.

    True when: the root is a trakcli store of this schema version whose recorded
    ``identity`` and ``layout`` equal this run's (as JSON); no ``eval/`` group waits
    to be moved back into it (``featurize --overwrite`` interrupted); and for each
    checkpoint ``model_id`` (the i-th of ``shas``) ``train/<model_id>`` records
    that sha256 and holds ``features [n_train, proj_dim]``, ``out_to_loss [n_train]``,
    ``nonfinite [n_train]`` of this layout, a ``done`` flag set for every row chunk,
    and (with ``kernel_settings``) a ``kernel`` finished with those settings.

    Args:
        path: the store directory.
        identity: this run's identity (what :meth:`Store.create_or_check` compares).
        layout: this run's array layout.
        shas: the sha256 of each checkpoint, by model_id.
        kernel_settings: the ridge settings each checkpoint's kernel must have been made
            with (``trakcli.jobs.kernels.ridge_settings``; compared as
            :func:`trakcli.store.kernel.kernel_done` does); None: kernels are not looked at.
        state_shas: with the second-moment correction, the sha256 of each checkpoint's optimizer
            state, which ``train/<model_id>`` must record too.

    Returns:
        True if a featurize run would find nothing to compute and nothing to record;
        False otherwise, including when any file is missing, unreadable or unexpected
        (the caller then opens the store through zarr, which says what is wrong).
    """
    if is_url(str(path)) or is_remote(path):  # an object store: read through zarr, whose reads are concurrent
        return False
    path = Path(path)
    root = _meta(path, "group")
    if root is None or (eval_kept(path).is_dir() and not (path / "eval").exists()):
        return False
    attrs = root.get("attributes", {})
    if attrs.get("schema_version") != SCHEMA_VERSION or attrs.get("identity") != jsonable(identity):
        return False
    if attrs.get(LAYOUT_ATTR) != jsonable(layout.to_attrs()) or _meta(path / "train", "group") is None:
        return False
    n, d, rows = layout.n_train, layout.proj_dim, layout.chunk_rows
    arrays = {
        "features": ([n, d], [rows, d], layout.dtype),
        "out_to_loss": ([n], [rows], "float32"),
        "nonfinite": ([n], [rows], "uint8"),
    }
    for model_id, sha in enumerate(shas):
        group = path / "train" / str(model_id)
        meta = _meta(group, "group")
        if meta is None or meta.get("attributes", {}).get("sha256") != sha:
            return False
        if state_shas is not None and meta.get("attributes", {}).get("optimizer_state_sha256") != state_shas[model_id]:
            return False
        if not all(_data_array(group / name, *spec) for name, spec in arrays.items()):
            return False
        if not _all_done(group / "done", -(-n // rows)):
            return False
        if kernel_settings is not None and not _kernel_done(group / "kernel", kernel_settings):
            return False
    return True
