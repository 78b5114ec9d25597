"""scikit-learn's bundled handwritten digits, split into train and target rows."""

from __future__ import annotations

import numpy as np
import torch

DIGITS_TEST_FRACTION = 0.2
DIGITS_SEED = 0
DIGITS_IMAGE_SHAPE = (8, 8)  # each flat row of 64 pixels is an 8x8 image


def load_digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes), split the same way every call.

    The split is fixed: ``sklearn.model_selection.train_test_split`` with ``test_size=0.2``, ``random_state=0`` and
    stratified by label, giving 1437 train and 360 target rows. Pixels (0..16) are scaled to [0, 1].

    Returns:
        ``(x_train [1437, 64] float32, y_train [1437] int64, x_target [360, 64] float32, y_target [360] int64)``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_ta, y_tr, y_ta = map(torch.from_numpy, train_test_split(
        x.astype(np.float32) / 16.0, y.astype(np.int64), test_size=DIGITS_TEST_FRACTION, random_state=DIGITS_SEED,
        stratify=y))
    return x_tr, y_tr, x_ta, y_ta
