"""Loading the dataset a config section describes: the bundled digits, a tensor file, or text and
language-model data (read lazily, :class:`trakcli.data.text.TextDataset`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trakcli.data.digits import DIGITS_IMAGE_SHAPE, load_digits_split
from trakcli.data.tensors import TensorDataset
from trakcli.data.sources import data_files
from trakcli.data.text import TextDataset
from trakcli.errors import DataError, StoreError, exception_text
from trakcli.labels import as_tensor, class_labels

if TYPE_CHECKING:  # the config schema is only read here (attributes), never built
    from trakcli.config import DatasetConfig


def _tensor_file(path: str | Path, key: str) -> Path:
    """The one local file of a tensor dataset's path (a Hub URL resolved, :func:`~trakcli.data.text.data_files`)."""
    files = data_files(path, key=key)
    if len(files) != 1 or files[0].is_dir():
        raise DataError(f"{key}.path {str(path)!r} names {len(files)} files or a folder; a tensor dataset reads one "
                        ".pt or .npz file: name it in the URL (hf://datasets/ORG/NAME/FILE.pt)")
    return files[0]


def _where(cfg: DatasetConfig) -> str:
    """The file (or the files, comma-separated) a dataset section reads, for names and messages."""
    return ", ".join(str(p) for p in cfg.paths) if isinstance(cfg.path, list) else str(cfg.path)


def _read_file(path: Path) -> dict[str, Any]:
    suffix = path.suffix.lower()
    if suffix not in (".npz", ".pt", ".pth"):
        raise DataError(f"data file {path} has suffix {suffix!r}; use a .pt dict of tensors or an .npz file")
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as f:
                return {k: f[k] for k in f.files}
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # unreadable or corrupt file
        raise DataError(f"cannot read data file {path}: {exception_text(e)}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path} holds a {type(obj).__name__}, not a dict of tensors; save it as "
                        f"torch.save({{'x_train': x, 'y_train': y, ...}}, path)")
    return obj


def checked_dataset(
    inputs: Any, labels: Any, *, key: str, name: str, inputs_what: str = "inputs", labels_what: str = "labels",
    source: str = "", task: Any = None,
) -> TensorDataset:
    """Inputs and labels validated as every tensor dataset is (a file's and the Python API's batches alike).

    Args:
        inputs: ``[n, ...]`` numbers, or a dict of them (the model's keyword inputs; the same ``n`` each).
        labels: ``[n, ...]``, checked by ``task`` (:meth:`trakcli.tasks.Task.check_labels`; None: as the
            built-in tasks, ``[n]`` integer class indices >= 0, or beside an ``input_ids`` input ``[n, L]``
            per-token labels, -100 where not a target); a task of one's own takes any ``[n, ...]`` numbers.
        key, name, inputs_what, labels_what, source: what messages call the data (``"data.train"``), the
            dataset's name, its inputs (``"inputs 'x'"``), its labels, and where they come from (``" of data.pt"``).

    Returns:
        The dataset: float inputs as float32 (integer and bool ones keep their dtype in a dict),
        the labels as the task's :meth:`~trakcli.tasks.Task.check_labels` returns them.

    Raises:
        DataError: values that are not numbers, empty inputs, inputs and labels (or several inputs)
            of different numbers of rows, labels the task refuses.
    """
    t = _ClassLabels() if task is None else task
    if isinstance(inputs, dict):
        keys = list(inputs)
        if not keys:
            raise DataError(f"{key}: no inputs; name the tensors the model takes")
        xs = {k: as_tensor(v, f"{key}: inputs {k!r}{source}", "numbers") for k, v in inputs.items()}
        n = {k: (x.shape[0] if x.ndim else 0) for k, x in xs.items()}
        if len(set(n.values())) != 1 or 0 in n.values():
            raise DataError(f"{key}: the inputs {keys} must have the same number of rows (> 0); rows per key: {n}")
        xs = {k: (x.to(torch.float32) if x.is_floating_point() else x).contiguous() for k, x in xs.items()}
        ids = xs.get("input_ids")
        token_shape = list(ids.shape) if ids is not None and ids.ndim == 2 else None
        y = t.check_labels(labels, what=labels_what, source=source, key=key, n=next(iter(n.values())),
                           token_shape=token_shape)
        return TensorDataset(xs, y, name)
    x = as_tensor(inputs, f"{key}: {inputs_what}{source}", "numbers")
    y = as_tensor(labels, f"{key}: {labels_what}{source}", t.label_values)
    if x.ndim == 0 or x.shape[0] == 0:
        raise DataError(f"{key}: {name} is empty (shape {list(x.shape)}); it needs at least one row")
    if y.ndim >= 1 and y.shape[0] != x.shape[0]:
        raise DataError(f"{key}: {x.shape[0]} inputs but {y.shape[0]} labels; {inputs_what.removeprefix('inputs ')} "
                        f"and {labels_what.removeprefix('labels ')} must have the same number of rows")
    y = t.check_labels(y, what=labels_what, source=source, key=key, n=x.shape[0])
    return TensorDataset(x.to(torch.float32).contiguous(), y, name)


class _ClassLabels:
    """Labels read as the built-in tasks read them, where no task is given (:func:`~trakcli.labels.class_labels`)."""

    label_values = "integer class indices"

    def check_labels(self, labels: Any, *, n: int, key: str = "data", what: str = "labels", source: str = "",
                     token_shape: list[int] | None = None) -> torch.Tensor:
        return class_labels(labels, what, source, key, n, token_shape)


def _concat_files(files: list[tuple[Any, dict[str, Any]]], needed: list[str], key: str) -> dict[str, Any]:
    """The ``needed`` keys of several tensor files' contents, each concatenated along its rows in file order.

    Raises:
        DataError: a file lacks a key, or a key's rows have another shape or kind in another file
            (names the files and shapes).
    """
    out: dict[str, Any] = {}
    for name in dict.fromkeys(needed):
        parts = []
        for path, contents in files:
            if name not in contents:
                raise DataError(f"{key}: {path} has no key {name!r}; its keys are {sorted(contents)} (every file of "
                                "a list of data files holds the same keys)")
            parts.append((path, as_tensor(contents[name], f"{key}: {name!r} of {path}", "numbers")))
        shapes = {str(path): list(t.shape[1:]) for path, t in parts}
        if len({str(v) for v in shapes.values()}) > 1 or any(t.ndim == 0 for _, t in parts):
            raise DataError(f"{key}: {name!r} has rows of different shapes in the files of the list: {shapes}; every "
                            "file's rows must have one shape (text token tensors: pad each file to the same width)")
        try:
            out[name] = torch.cat([t for _, t in parts])
        except (RuntimeError, TypeError) as e:
            raise DataError(f"{key}: the files' {name!r} cannot be joined: {exception_text(e)}") from None
    return out


def load_dataset(cfg: DatasetConfig, *, key: str = "data.train", task: Any = None) -> TensorDataset | TextDataset:
    """Load the dataset the config section ``cfg`` describes (``builtin`` + ``split``, ``path`` + ``inputs`` +
    ``labels``, or ``path`` + one of ``text`` / ``prompt`` + ``completion`` / ``messages`` / ``input_ids``;
    ``path`` may be a list of files, read as one dataset). ``key`` is the dotted config key messages name.

    Returns:
        A :class:`TensorDataset` for built-in data and tensor files (:func:`checked_dataset`: the labels
        as ``task`` reads them, None: class indices), or for text and language-model data a
        :class:`~trakcli.data.text.TextDataset`, which reads and tokenizes rows as its batches need them.

    Raises:
        DataError: unreadable file, missing key or field, empty data, mismatched lengths
            or bad labels, files of a list whose rows differ in shape.
    """
    if cfg.builtin == "digits":
        x_tr, y_tr, x_ta, y_ta = load_digits_split()
        if cfg.split == "train":
            return TensorDataset(x_tr, y_tr, "digits/train", image_shape=DIGITS_IMAGE_SHAPE)
        return TensorDataset(x_ta, y_ta, "digits/target", image_shape=DIGITS_IMAGE_SHAPE)
    if any(getattr(cfg, f) is not None for f in ("text", "prompt", "completion", "messages", "input_ids")):
        if cfg.path is None or (cfg.tokenizer is None and cfg.input_ids is None):  # the config model refuses
            raise DataError(f"{key}: a text dataset needs `path` and `tokenizer`")
        return TextDataset(cfg.path, text=cfg.text, text_pair=cfg.text_pair, labels=cfg.labels, prompt=cfg.prompt,
                           completion=cfg.completion, messages=cfg.messages, input_ids=cfg.input_ids,
                           tokenizer=cfg.tokenizer, max_length=cfg.max_length, key=key)
    if cfg.path is None or cfg.inputs is None or cfg.labels is None:  # the config model fills all three or refuses
        raise DataError(f"{key}: a file dataset needs `path`, `inputs` and `labels`")
    keys = [cfg.inputs] if isinstance(cfg.inputs, str) else list(cfg.inputs)
    if not keys:
        raise DataError(f"{key}.inputs: an empty list; name the keys of {_where(cfg)} the model takes")
    if isinstance(cfg.path, list):
        contents = _concat_files([(p, _read_file(_tensor_file(p, key))) for p in cfg.path], keys + [cfg.labels], key)
    else:
        contents = _read_file(_tensor_file(cfg.path, key))
    missing = [k for k in dict.fromkeys(keys + [cfg.labels]) if k not in contents]
    if missing:
        raise DataError(f"{key}: {_where(cfg)} has no key {', '.join(repr(m) for m in missing)}; its keys are "
                        f"{sorted(contents)}")
    # several input tensors (inputs: [a, b]) are a dict passed to the model as keyword arguments
    inputs = contents[cfg.inputs] if isinstance(cfg.inputs, str) else {k: contents[k] for k in keys}
    return checked_dataset(inputs, contents[cfg.labels], key=key, name=f"{_where(cfg)}[{','.join(keys)}]",
                           inputs_what=f"inputs {cfg.inputs!r}", labels_what=f"labels {cfg.labels!r}",
                           source=f" of {_where(cfg)}", task=task)


def sequence_width(data: Any) -> int:
    """Most tokens a row of token data has: ``max_length`` for text data (with ``max_length`` None the
    longest row, :meth:`TextDataset.longest`), ``L`` for ``[n, L]`` tensors of ``input_ids``; 0 for data
    without tokens."""
    if isinstance(data, TextDataset):
        return data.max_length if data.max_length is not None else data.longest()
    inputs = getattr(data, "inputs", None)
    if isinstance(inputs, dict) and "input_ids" in inputs and getattr(inputs["input_ids"], "ndim", 0) == 2:
        return int(inputs["input_ids"].shape[1])
    return int(getattr(data, "max_length", 0) or 0)


def check_target_inputs(target: dict[str, Any], train: dict[str, Any]) -> None:
    """Refuse targets whose inputs are not of the train data's kind, from the two fingerprints (the train's:
    the store's ``train_data``).

    Token data (inputs a dict holding ``input_ids``) must have the same input keys and dtypes; the
    sequence lengths may differ, since every gradient, and so every feature, is one example's.
    Other data must have the same per-example shape and dtype.

    Raises:
        StoreError: inputs of another kind, naming both and the fix.
    """
    t_shape, s_shape = target.get("input_shape"), train.get("input_shape")
    t_type, s_type = target.get("input_dtype"), train.get("input_dtype")
    tokens = all(isinstance(v, dict) and "input_ids" in v for v in (t_shape, s_shape))
    if tokens and (sorted(t_shape) != sorted(s_shape) or t_type != s_type):
        raise StoreError(f"data.target inputs are {sorted(t_shape)} of dtypes {t_type} but the train inputs are "
                         f"{sorted(s_shape)} of dtypes {s_type}; give targets of the train data's kind (the same "
                         "fields, e.g. text_pair on both or on neither)")
    if not tokens and (t_shape != s_shape or t_type != s_type):
        raise StoreError(f"data.target inputs have shape {t_shape} ({t_type}) per example but the train inputs have "
                         f"{s_shape} ({s_type}); targets must be examples of the train data's kind")
