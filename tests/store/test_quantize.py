"""int8 and binary (1-bit) codes of train features (trakcli.store.quantize): error bounds, signs, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from trakcli.errors import StoreError
from trakcli.store.quantize import code_arrays, decode, encode, feature_dtype, signs


def rows(seed=0, n=200, d=77):
    g = np.random.default_rng(seed)
    x = g.standard_normal((n, d)).astype(np.float32) * (10.0 ** g.integers(-6, 6, n))[:, None].astype(np.float32)
    x[3] = 0  # an all-zero row
    return x


def test_int8_round_trip_is_within_half_a_step_of_each_row():
    x = rows()
    c = encode("int8", x)
    assert c["codes"].dtype == np.int8 and c["codes"].shape == x.shape and c["scale"].dtype == np.float32
    assert c["codes"].min() >= -127 and c["codes"].max() <= 127
    back = decode("int8", c["codes"], c["scale"], x.shape[1])
    bound = np.abs(x).max(1) / 254  # scale / 2, per row
    err = np.abs(back - x).max(1)
    assert (err <= bound * (1 + 1e-5) + 1e-30).all()
    assert (err[bound > 0] > bound[bound > 0] * 0.5).mean() > 0.9  # the bound is reached, not loose by orders
    np.testing.assert_array_equal(back[3], 0)
    # the largest entry of each row is coded exactly as ±127
    assert (np.abs(c["codes"]).max(1)[np.abs(x).max(1) > 0] == 127).all()


def test_binary_codes_keep_every_sign_and_the_mean_absolute_value():
    x = rows(1)
    c = encode("binary", x)
    assert c["codes"].dtype == np.uint8 and c["codes"].shape == (x.shape[0], 10)  # ceil(77 / 8) bytes
    s = signs("binary", c["codes"], x.shape[1])
    assert s.dtype == np.int8 and set(np.unique(s)) <= {-1, 1}
    np.testing.assert_array_equal(s[x > 0], 1)
    np.testing.assert_array_equal(s[x <= 0], -1)
    np.testing.assert_allclose(c["scale"], np.abs(x).mean(1), rtol=1e-6)
    back = decode("binary", c["codes"], c["scale"], x.shape[1])
    # the mean |x| is the scale that minimizes the squared error of sign(x) · s (XNOR-Net, Eq. 4)
    for factor in (0.9, 1.1):
        worse = s * (c["scale"] * factor)[:, None]
        assert (((worse - x) ** 2).sum(1) >= ((back - x) ** 2).sum(1) - 1e-6 * (x**2).sum(1)).all()


def test_non_finite_entries_do_not_spoil_the_scale():
    x = rows(2, n=4, d=16)
    x[0, 0], x[1, 1] = np.inf, np.nan
    c = encode("int8", x)
    assert np.isfinite(c["scale"]).all()
    assert c["codes"][1, 1] == 0


def test_layout_of_the_codes():
    assert feature_dtype("int8") == feature_dtype("binary") == "bfloat16" and feature_dtype("float16") == "float16"
    assert code_arrays("int8", 10, 33) == {"codes": ((10, 33), "int8"), "scale": ((10,), "float32")}
    assert code_arrays("binary", 10, 33) == {"codes": ((10, 5), "uint8"), "scale": ((10,), "float32")}
    assert code_arrays("float32", 10, 33) == {}


def test_bad_input_is_refused_with_the_value():
    with pytest.raises(StoreError, match=r"2-D floating-point array \[rows, proj_dim\], got shape \[5\] and dtype"):
        encode("int8", np.zeros(5, np.float32))
    with pytest.raises(StoreError, match="got shape \\[2, 3\\] and dtype int64"):
        encode("binary", np.zeros((2, 3), np.int64))
    with pytest.raises(StoreError, match="no codes for store.dtype 'float16'; choose one of int8, binary"):
        encode("float16", np.zeros((2, 3), np.float32))
