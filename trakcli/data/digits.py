"""scikit-learn's bundled handwritten digits, split once into train and target rows."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np
import torch

from trakcli.files import atomic_open

DIGITS_TEST_FRACTION = 0.2
DIGITS_SEED = 0
DIGITS_IMAGE_SHAPE = (8, 8)  # each flat row of 64 pixels is an 8x8 image


def load_digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes), split once.

    The split is fixed: ``sklearn.model_selection.train_test_split`` with
    ``test_size=0.2``, ``random_state=0`` and stratified by label, giving
    1437 train and 360 target rows. Pixels (0..16) are scaled to [0, 1].

    Returns:
        ``(x_train [1437, 64] float32, y_train [1437] int64,
        x_target [360, 64] float32, y_target [360] int64)``.

    The split is kept in ``$XDG_CACHE_HOME/trakcli`` (default ``~/.cache/trakcli``),
    one file per scikit-learn version, so that later runs skip importing
    scikit-learn (~1 s, with scipy); a cache that cannot be read or written is ignored.
    """
    cache = _split_cache()
    arrays = _read_split(cache)
    if arrays is None:
        arrays = _split_with_sklearn()
        _write_split(cache, arrays)
    x_tr, y_tr, x_ta, y_ta = (torch.from_numpy(a) for a in arrays)
    return x_tr, y_tr, x_ta, y_ta


_SPLIT_SHAPES = (((1437, 64), np.float32), ((1437,), np.int64), ((360, 64), np.float32), ((360,), np.int64))


def _split_with_sklearn() -> list[np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_ta, y_tr, y_ta = train_test_split(
        x, y, test_size=DIGITS_TEST_FRACTION, random_state=DIGITS_SEED, stratify=y
    )
    as_x = lambda a: np.asarray(a, dtype=np.float32) / 16.0  # noqa: E731
    as_y = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    return [as_x(x_tr), as_y(y_tr), as_x(x_ta), as_y(y_ta)]


def _split_cache() -> Path | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        sklearn_version = version("scikit-learn")
    except PackageNotFoundError:
        return None
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trakcli"
    return root / f"digits-split-sklearn{sklearn_version}-test{DIGITS_TEST_FRACTION}-seed{DIGITS_SEED}.npz"


def _read_split(path: Path | None) -> list[np.ndarray] | None:
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = [f[f"a{i}"] for i in range(4)]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    ok = all(a.shape == shape and a.dtype == dtype for a, (shape, dtype) in zip(arrays, _SPLIT_SHAPES))
    return arrays if ok else None


def _write_split(path: Path | None, arrays: list[np.ndarray]) -> None:
    if path is None:
        return
    try:  # a cache: a failed write is only a slower next run
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path, "wb") as f:
            np.savez(f, **{f"a{i}": a for i, a in enumerate(arrays)})
    except OSError:
        pass
