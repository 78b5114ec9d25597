"""The Zarr v3 store: layout, resume, locking, provenance, checksums, export; the checkpoint manifest.

The only part of trakcli that imports zarr. Layout (docs/guides/store.md)::

    <store>.zarr/                  attrs: schema_version, trakcli_version, config (resolved),
                                   identity (everything the train features depend on),
                                   layout (n_train, proj_dim, chunk_rows, dtype, compressor:
                                   the StoreLayout featurize gave), appends (each growth of
                                   the train rows: n_train_before, n_train, date)
      train/<model_id>/            attrs: checkpoint, sha256 (and appended_into: the old partly
                                   filled chunk an append grew, trakcli.store.append)
        features    [n_train, proj_dim] float32 (or float16, or bfloat16 kept as uint16 bits with
                                        attrs logical_dtype, encoding: trakcli.store.bfloat16), chunked by rows
        out_to_loss [n_train]           float32
        nonfinite   [n_train]           uint8, 1 = skipped (--skip-nonfinite), features zero
        done        [n_row_chunks]      uint8, set after the chunk's data is written
        kernel      [proj_dim, proj_dim] float64 lower Cholesky factor of ΦᵀΦ + λI (attr form
                                        cholesky_lower), or when n_train < proj_dim [n_train, proj_dim]
                                        float32 (ΦΦᵀ + λI)⁻¹Φ (dual_solved_features: trakcli.scoring);
                                        its attrs (form, lambda_reg, settings) are written last
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

Rules: the root and every group are created with their attributes in the
same (atomic) ``zarr.json`` write, so a store or group is whole or absent;
``featurize --overwrite`` renames the old store aside before deleting it. A
chunk's data is written before its ``done`` flag; a resumed run
recomputes only chunks not done; a run whose identity differs from the
store's refuses (naming the differing keys) unless ``overwrite``. Every chunk
carries a CRC32C checksum and every done chunk keeps its file (arrays are
written with ``write_empty_chunks``), so a corrupt, truncated or missing chunk
is reported with its array, chunk index and the command that repairs it
instead of being read as wrong numbers (zarr reads a missing chunk as zeros).
What the records imply is checked too (``trak inspect``, ``trak export``): an
experiment's ``checkpoints`` imply ``train/<m>`` holding those checkpoints'
features and ``targets/<experiment>/<m>``; every group has its arrays and every
directory its ``zarr.json``. A plain ``trak featurize`` re-creates a lost array's
metadata over its chunk files and recomputes done chunks whose files are gone.
Train features are repaired by ``trak featurize CONFIG --verify``; the derived
arrays (kernels, target features, scores) are verified when read and rebuilt
by a plain ``trak score CONFIG``. Arrays are
written from numpy, never from torch tensors. Parallel writers (torchrun
ranks) write disjoint chunks; ``done`` has one chunk per flag so flags of
different writers never share a file, and attributes are written by rank 0.

The ``eval/`` group (`trak eval`'s counterfactual retraining) does not depend
on the projector or the checkpoints: ``trak eval`` may create the store before
``trak featurize`` (a root without an identity, which featurize then adopts),
and ``featurize --overwrite`` keeps it across the re-creation of the store.

Modules:

- :mod:`~trakcli.store.identity`: ``flatten``, ``jsonable``, ``differing_keys``,
  ``diff_keys``, ``settings_mismatch``, ``check_same``: the one
  key-by-key diff of settings and the one check of recorded settings (no zarr).
- :mod:`~trakcli.store.layout`: :class:`StoreLayout`, the array shapes and storage
  the caller tells the store (n_train, proj_dim, chunk_rows, dtype, compressor) (no zarr).
- :mod:`~trakcli.store.bfloat16`: bfloat16 features as ``uint16`` bits, rounded on write
  and read back as float32 (no zarr).
- :mod:`~trakcli.store.lock`: :class:`StoreLock`, the ``<store>.lock`` file (no zarr).
- :mod:`~trakcli.store.manifest`: the manifest of `trak optimize`'s checkpoints,
  read by config resolution (no zarr, no torch).
- :mod:`~trakcli.store.integrity`: missing chunk files, unreadable metadata, the
  repair command of each array, :class:`StoreCorruptError` (zarr imported lazily).
- :mod:`~trakcli.store.rows`: :class:`ChunkedRows`, :class:`EvalRows`, the checked read.
- :mod:`~trakcli.store.store`: :class:`Store`, with the checked reads and ``trak export``;
  :mod:`~trakcli.store.kernel`: the kernel array.
- :mod:`~trakcli.store.evalgroup`: the ``eval/`` group; :mod:`~trakcli.store.summary`:
  ``trak inspect``'s summary.

The modules that use zarr import it when a store is opened or an array created.
"""

from __future__ import annotations

from trakcli.store.append import StoreStaleError
from trakcli.store.identity import (
    check_same,
    diff_keys,
    differing_keys,
    flatten,
    jsonable,
    settings_mismatch,
)
from trakcli.store.integrity import StoreCorruptError, StoreMetadataError
from trakcli.store.layout import COMPRESSORS, STORAGE_DTYPES, StoreLayout
from trakcli.store.lock import StoreLock
from trakcli.store.rows import ChunkedRows, EvalRows
from trakcli.store.store import SCHEMA_VERSION, Store

__all__ = [
    "COMPRESSORS",
    "SCHEMA_VERSION",
    "STORAGE_DTYPES",
    "ChunkedRows",
    "EvalRows",
    "Store",
    "StoreCorruptError",
    "StoreMetadataError",
    "StoreStaleError",
    "StoreLayout",
    "StoreLock",
    "check_same",
    "diff_keys",
    "differing_keys",
    "flatten",
    "jsonable",
    "settings_mismatch",
]
