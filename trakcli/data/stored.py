"""The train rows of a store whose train data file is gone: what the store recorded of them, and no rows.

`trak score` reads the train *features* from the store; of the rows themselves it needs only their count and
fingerprint, which the store recorded when it was made (``identity["train_data"]``). So a store still scores
after its train data file was moved or deleted. What does need the rows (exact scores, the curvature
refinement, per-token scores, the texts beside the top-k) says which file is missing.
"""

from __future__ import annotations

from typing import Any

from trakcli.errors import DataError


class StoredRows:
    """Stands in for a :class:`~trakcli.data.tensors.TensorDataset` of train rows the store has recorded.

    Args:
        fingerprint: the store's ``identity["train_data"]``: ``{"n", "input_shape", "input_dtype", "sha256"}``.
        missing: the missing data file(s), as written in the config (named by every error); empty where the
            rows were never given (:meth:`trakcli.Attributor.score`). ``labels`` is None (not stored).
    """

    labels = None

    def __init__(self, fingerprint: dict[str, Any], missing: list[str]):
        self._fingerprint = dict(fingerprint)
        self.missing = list(missing)

    def __len__(self) -> int:
        return int(self._fingerprint["n"])

    def fingerprint(self, n: int | None = None) -> dict[str, Any]:
        """The recorded fingerprint (of every row; a prefix cannot be fingerprinted without the rows).

        Raises:
            DataError: ``n`` asks for a prefix.
        """
        if n is not None and n != len(self):
            raise self.unavailable(f"the fingerprint of the first {n} rows")
        return dict(self._fingerprint)

    def unavailable(self, what: str) -> DataError:
        """The error of a step that needs the rows: names the missing file and the fixes."""
        if not self.missing:  # Attributor.score: the train rows are not given to it, only recorded by the store
            return DataError(f"{what} needs the train rows, which scoring reads only as the store recorded them "
                             "(count and fingerprint); use the train batches you featurized")
        files = ", ".join(self.missing)
        return DataError(f"{what} needs the train rows, but data.train's file {files} is missing (the store's features "
                         "were read without it); restore the file, or score without what needs the rows")

    def batches(self, *args: Any, **kwargs: Any):
        """Refused: names the missing file (:meth:`unavailable`)."""
        raise self.unavailable("this step")

    batches_of = batches
