"""The finished arrays of a store, read checked and exported (:class:`FinishedArrays`, a part of
:class:`trakcli.store.Store`): every read of a finished array checks that it is finished, made from the store's
current train rows, and not damaged, and names the command that makes or repairs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from trakcli.errors import StoreError
from trakcli.files import atomic_open
from trakcli.store.append import stale_error
from trakcli.store.bfloat16 import logical_dtype
from trakcli.store.integrity import (
    StoreCorruptError, finishing_command, keys, node, repair_command,
)
from trakcli.store.rows import read_checked


class FinishedArrays:
    """Checked reads and export of a store's finished arrays (the methods :class:`~trakcli.store.Store` has from
    this part; they use its ``root``, ``path``, ``identity`` and ``layout``)."""

    def array(self, name: str) -> Any:
        """The zarr array at ``name`` (e.g. ``train/0/features``, ``scores/default/scores``).

        Raises:
            StoreError: no such array (lists what the store holds).
            StoreMetadataError: its ``zarr.json`` is unreadable (names the repair).
        """
        arr = node(self.root, name)
        if arr is None or not hasattr(arr, "shape"):
            have = [f"train/{m}/features" for m in self.model_ids()]
            scores = node(self.root, "scores")
            if scores is not None:
                for e in keys(scores):
                    have += [f"scores/{e}/{a}" for a in ("scores", "top_k") if node(scores, f"{e}/{a}") is not None]
            if node(self.root, "eval") is not None:
                have += ["eval/masks", "eval/outputs"]
            raise StoreError(f"store {self.path} has no array {name!r}; it holds {', '.join(have) or 'nothing yet'}")
        return arr

    def _finished(self, name: str) -> tuple[Any, bool]:
        """The array ``name`` once it is fresh (no scores from before an append), finished and made from the
        store's train features; and whether its chunks must all have files."""
        arr = self.array(name)
        parts = name.split("/")
        stale = stale_error(self, parts[1]) if len(parts) > 2 and parts[0] == "scores" else None
        if stale is not None:
            raise stale
        stored = self._check_finished(name, arr)
        self._check_sources(name)
        return arr, stored

    def _check_finished(self, name: str, arr: Any) -> bool:
        """Refuse an array with chunks not computed yet (naming how many, the first ones and the command that
        finishes them: StoreError); returns whether its chunks must all have files."""
        parts = name.split("/")
        leaf = parts[-1]
        if leaf == "done":
            return False  # flags: a missing chunk is a flag not set
        if leaf == "kernel":
            if "lambda_reg" not in arr.attrs:
                raise StoreError(
                    f"store array {name} in {self.path} is unfinished (its kernel was never completed); run "
                    f"{finishing_command(name)} to compute it"
                )
            return True
        done = node(self.root, "/".join(parts[:-1] + ["done"]))
        if done is None:
            return True
        flags = read_checked(done, slice(None), 0, stored=False)
        pending = np.flatnonzero(flags == 0)
        if pending.size:
            unit = "column blocks" if parts[0] == "scores" else ("rows" if parts[0] == "eval" else "row chunks")
            first = ", ".join(str(int(c)) for c in pending[:10]) + (", ..." if pending.size > 10 else "")
            raise StoreError(
                f"store array {name} in {self.path} is unfinished: {pending.size} of {flags.size} {unit} are not "
                f"computed yet ({first}); run {finishing_command(name)} to finish them"
            )
        return True

    def _check_sources(self, name: str) -> None:
        """Refuse (StoreCorruptError) an array of ``targets/<experiment>`` or ``scores/<experiment>`` when a
        ``train/<m>`` of the checkpoints it records (their sha256) is missing or holds another checkpoint's features."""
        parts = name.split("/")
        if len(parts) < 2 or parts[0] not in ("targets", "scores"):
            return
        exp = "/".join(parts[:2])
        group = node(self.root, exp)
        recorded = group.attrs.get("checkpoints") if group is not None else None
        for m, sha in enumerate(recorded if isinstance(recorded, list) else []):
            train = node(self.root, f"train/{m}")
            if train is None:
                raise StoreCorruptError(
                    f"{exp} in {self.path} was made with the train features of model_id {m}, but "
                    f"store group train/{m} is missing; {repair_command(f'train/{m}')}", f"train/{m}",
                )
            if train.attrs.get("sha256") != sha:
                raise StoreCorruptError(
                    f"{exp} in {self.path} was made from checkpoint sha256 {str(sha)[:12]} for model_id "
                    f"{m}, but train/{m} holds the features of sha256 {str(train.attrs.get('sha256'))[:12]}; "
                    f"{repair_command(exp)}", exp,
                )

    def read(self, name: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows ``[lo, hi)`` (axis 0) of the finished array ``name``, every chunk checked.

        In the array's dtype; float32 for bfloat16 features (:mod:`trakcli.store.bfloat16`).

        Raises:
            StoreError: no such array, or an unfinished one (names the command that finishes it).
            StoreCorruptError: a chunk is missing or fails its checksum, or the train features an
                experiment's array was made from are gone (:meth:`_check_sources`); names the repair.
            StoreStaleError: an experiment's scores made before train rows were appended (names the rescore).
        """
        arr, stored = self._finished(name)
        return read_checked(arr, slice(lo, hi), 0, stored=stored)

    def read_scores(self, experiment: str) -> tuple[np.ndarray, dict[str, Any]]:
        """The finished score matrix of an experiment and the attributes it was made with."""
        name = f"scores/{experiment}"
        group = node(self.root, name)
        if group is not None and node(group, "scores") is None and node(group, "top_k") is not None:
            raise StoreError(
                f"experiment {experiment!r} in {self.path} holds only its top-k (score.top_k), not the full score "
                "matrix this needs; run `trak score CONFIG score.full=true`"
            )
        if group is None or node(group, "scores") is None:
            raise StoreError(
                f"store {self.path} holds no scores of experiment {experiment!r} (score.experiment); "
                "run `trak featurize CONFIG` and `trak score CONFIG` first"
            )
        return self.read(f"{name}/scores"), dict(group.attrs)

    def export(self, name: str, out: Path, row_block: int = 4096) -> tuple[int, ...]:
        """Stream the finished array ``name`` to ``out`` (.npy, or .csv for 1-D/2-D) block by block, through a
        temporary file renamed into place (a failure leaves an existing ``out`` as it was). The .npy file has the
        array's dtype; bfloat16 features are written as float32 (the same numbers, at twice the bytes).

        Returns:
            The exported shape.

        Raises:
            StoreError: unknown or unfinished array (names the command that finishes it), unwritable output.
            StoreCorruptError: a chunk is missing or fails its checksum, or (scores, target features) the
                train features they were made from are gone (:meth:`_check_sources`); names the repair.
            StoreStaleError: an experiment's scores made before train rows were appended (names the rescore).
        """
        arr, stored = self._finished(name)
        shape = tuple(int(n) for n in arr.shape)
        dtype = np.dtype(logical_dtype(arr))  # bfloat16 bits: float32 (numpy has no bfloat16)
        kept = f"; {out} is unchanged" if out.exists() else f"; nothing was written to {out}"

        def blocks():
            for lo in range(0, shape[0], row_block):
                yield read_checked(arr, slice(lo, lo + row_block), 0, stored=stored)

        try:
            if out.suffix.lower() == ".npy":
                with atomic_open(out, "wb") as f:
                    np.lib.format.write_array_header_1_0(  # a plain dtype and shape: far below 1.0's 64 KiB
                        f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})
                    for block in blocks():
                        f.write(np.ascontiguousarray(block, dtype=dtype).tobytes())
            else:
                with atomic_open(out, "w") as f:
                    for block in blocks():
                        np.savetxt(f, block.reshape(block.shape[0], -1), delimiter=",", fmt="%.7g")
        except StoreCorruptError as e:
            raise StoreCorruptError(f"{e}{kept}", e.array, e.chunks) from None
        except OSError as e:
            raise StoreError(f"cannot write {out}: {e}{kept}") from None
        return shape

