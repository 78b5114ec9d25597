"""Datasets: the bundled digits data, user tensor files, and text and language-model data.

Every dataset has ``__len__``, ``name``, ``labels`` (``[n, ...]``), ``fingerprint()``
and ``batches(start, stop, batch_size, max_tokens=None)`` yielding
``(row_offset, inputs, labels)``:

* :class:`TensorDataset` (:mod:`trakcli.data.tensors`) holds its rows in memory:
  ``inputs`` a tensor ``[n, ...]`` (float32) or a dict of tensors, ``labels`` as the
  task reads them (:meth:`trakcli.tasks.Task.check_labels`): ``[n]`` int64 class indices
  (or ``[n, L]`` per-token labels beside ``input_ids``) for the built-in tasks, any
  ``[n, ...]`` numbers for a task of one's own (float targets as float32). Batching is
  slicing rows.
* :class:`TextDataset` (:mod:`trakcli.data.text`) reads text and language-model
  files (``text``, ``prompt`` + ``completion``, ``messages``, ``input_ids``) and
  tokenizes rows as batches need them, each batch padded to its own longest row,
  with per-token labels (-100: not a target) for language models.

* :mod:`trakcli.data.digits`: the fixed train/target split of scikit-learn's digits.
* :mod:`trakcli.data.load`: :func:`load_dataset`, the dataset of a config section.
"""

from typing import Union

from trakcli.data.digits import DIGITS_IMAGE_SHAPE, DIGITS_SEED, DIGITS_TEST_FRACTION, load_digits_split
from trakcli.data.load import load_dataset
from trakcli.data.tensors import Inputs, TensorDataset, cut_batches, index_inputs, inputs_to, slice_inputs
from trakcli.data.text import IGNORE_INDEX, TextDataset, load_text, load_tokenizer

#: What :func:`load_dataset` returns.
Dataset = Union[TensorDataset, TextDataset]

__all__ = [
    "DIGITS_IMAGE_SHAPE",
    "DIGITS_SEED",
    "DIGITS_TEST_FRACTION",
    "IGNORE_INDEX",
    "Dataset",
    "Inputs",
    "TensorDataset",
    "TextDataset",
    "cut_batches",
    "index_inputs",
    "inputs_to",
    "load_dataset",
    "load_digits_split",
    "load_text",
    "load_tokenizer",
    "slice_inputs",
]
