"""Datasets: the bundled digits data, user tensor files and text files.

A dataset here is held in memory: ``inputs`` and ``labels [n]`` (int64 class
indices). ``inputs`` is a tensor ``[n, ...]`` (float32), or for text a dict of
tensors ``{"input_ids": [n, L], "attention_mask": [n, L]}`` (int64, tokenized by
:mod:`trakcli.data.text`). Batching is slicing rows (of every tensor of the dict).

* :mod:`trakcli.data.tensors`: :class:`TensorDataset` and the row helpers of ``Inputs``.
* :mod:`trakcli.data.digits`: the fixed train/target split of scikit-learn's digits.
* :mod:`trakcli.data.text`: ``.jsonl`` / ``.csv`` texts and their tokenizer.
* :mod:`trakcli.data.load`: :func:`load_dataset`, the dataset of a config section.
"""

from trakcli.data.digits import DIGITS_IMAGE_SHAPE, DIGITS_SEED, DIGITS_TEST_FRACTION, load_digits_split
from trakcli.data.load import load_dataset
from trakcli.data.tensors import Inputs, TensorDataset, index_inputs, inputs_to, slice_inputs
from trakcli.data.text import load_text, load_tokenizer

__all__ = [
    "DIGITS_IMAGE_SHAPE",
    "DIGITS_SEED",
    "DIGITS_TEST_FRACTION",
    "Inputs",
    "TensorDataset",
    "index_inputs",
    "inputs_to",
    "load_dataset",
    "load_digits_split",
    "load_text",
    "load_tokenizer",
    "slice_inputs",
]
