"""Datasets: the bundled digits data, user tensor files, and text and language-model data.

Every dataset has ``__len__``, ``name``, ``labels`` (``[n, ...]``), ``fingerprint()`` and
``batches(start, stop, batch_size, max_tokens=None)`` yielding ``(row_offset, inputs, labels)``:
:class:`TensorDataset` (:mod:`trakcli.data.tensors`) holds its rows in memory,
:class:`TextDataset` (:mod:`trakcli.data.text`) reads and tokenizes text rows as batches need them.
:func:`load_dataset` (:mod:`trakcli.data.load`) gives the dataset of a config section.
"""

from trakcli.data.digits import load_digits_split
from trakcli.data.load import load_dataset
from trakcli.data.tensors import TensorDataset
from trakcli.data.text import TextDataset

__all__ = ["TensorDataset", "TextDataset", "load_dataset", "load_digits_split"]
