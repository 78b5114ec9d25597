"""The Zarr v3 store: layout, resume, locking, provenance, checksums, export; the checkpoint manifest.

The only part of trakcli that imports zarr. Layout (docs/guides/store.md)::

    <store>.zarr/                  attrs: schema_version, trakcli_version, config (resolved), identity (what
                                   the train features depend on), layout (StoreLayout), appends (each
                                   growth of the train rows: n_train_before, n_train, date)
      train/<model_id>/            attrs: checkpoint, sha256 (and appended_into: the old partly
                                   filled chunk an append grew, trakcli.store.append)
        features    [n_train, proj_dim] float32 (or float16, or bfloat16 kept as uint16 bits with
                                        attrs logical_dtype, encoding: trakcli.store.bfloat16), chunked by rows
        out_to_loss [n_train]           float32
        nonfinite   [n_train]           uint8, 1 = skipped (--skip-nonfinite), features zero
        done        [n_row_chunks]      uint8, set after the chunk's data is written
        kernel      [proj_dim, proj_dim] float64 lower Cholesky factor of ΦᵀΦ + λI, or [n_train, proj_dim]
                                        float32 (ΦΦᵀ + λI)⁻¹Φ (trakcli.store.kernel); attrs written last
      targets/<experiment>/        attrs: target data fingerprint, checkpoints (sha256 per model_id)
        <model_id>/features [n_target, proj_dim], done [n_target_chunks]
      scores/<experiment>/         attrs: lambda settings, normalize, checkpoints, target data (and
                                   stale: the train rows it was scored over, once rows were appended)
        scores [n_target, n_train] float32, chunked by train rows (columns);
        done   [n_train_chunks]    one flag per column block
        top_k/                     attrs: k (score.top_k; trakcli.topk)
          proponents, opponents [n_target, k] int64 train indices, best first;
          proponent_scores, opponent_scores [n_target, k] float32; done [n_target_chunks]
        top_k_parts/               while a top-k pass runs: the same arrays per segment of train
                                   rows, [n_segments, n_target, k], done [n_segments]
      eval/                        attrs: identity (training recipe, model, train and target
                                   data, task, subset_fraction, eval seed), n_subsets
        masks   [n_subsets, n_train]  bool, the training rows of retrained model k
        outputs [n_subsets, n_target] float64, the targets' model outputs (margins) under model k
        done    [n_subsets]           uint8, set after row k of masks and outputs
    <store>.zarr.lock              JSON {host, pid, started}: the run using the store

Rules (docs/guides/store.md): a group is created with its attributes in one (atomic) ``zarr.json`` write; a chunk's data
is written before its ``done`` flag (a resumed run recomputes only chunks not done); a run whose identity differs from
the store's refuses, naming the differing keys; every chunk carries a CRC32C checksum and every done chunk keeps its
file, so damage is reported with the command that repairs it (:mod:`~trakcli.store.integrity`); torchrun ranks write
disjoint chunks, rank 0 the attributes. The ``eval/`` group does not depend on the projector or the checkpoints:
``trak eval`` may create the store before featurize (which adopts it), and ``featurize --overwrite`` keeps it. Modules
that use zarr import it when a store is opened or an array created.
"""

from __future__ import annotations

from trakcli.store.append import StoreStaleError
from trakcli.store.integrity import StoreCorruptError, StoreMetadataError
from trakcli.store.layout import (
    COMPRESSORS, STORAGE_DTYPES, StoreLayout, check_same, diff_keys, differing_keys, flatten, jsonable,
    settings_mismatch,
)
from trakcli.store.location import StoreLock
from trakcli.store.rows import ChunkedRows, EvalRows
from trakcli.store.store import SCHEMA_VERSION, Store

__all__ = [
    "COMPRESSORS", "SCHEMA_VERSION", "STORAGE_DTYPES", "ChunkedRows", "EvalRows", "Store", "StoreCorruptError",
    "StoreMetadataError", "StoreStaleError", "StoreLayout", "StoreLock", "check_same", "diff_keys", "differing_keys",
    "flatten", "jsonable", "settings_mismatch",
]
