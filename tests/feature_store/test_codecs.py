"""Codecs: round-trip error bounds (property-tested for int8), bf16 rounding, sizes, registry."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from feature_store.codecs import (BASELINE_CODEC, CODECS, DEFAULT_CODEC, bf16_bits_to_f32, f32_to_bf16_bits,
                                  get_codec, int8_quantize, reconstruction_error)


def realistic(rows=64, cols=576, seed=0):
    """Gaussian rows with a few large outlier channels, like transformer residual streams."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.5, 4, (rows, 1)).astype(np.float32)
    x[:, [3, 77, 400]] *= 40
    return x


@pytest.mark.parametrize("name", sorted(CODECS))
def test_round_trip_shape_and_bound(name):
    x = realistic()
    c = get_codec(name)
    y = c.decode(c.encode(x), *x.shape)
    assert y.shape == x.shape and y.dtype == np.float32
    rel = {"bf16": 2 ** -8, "fp16": 2 ** -11, "int8": None}[name.split("-")[0]]
    if rel is not None:
        assert np.all(np.abs(y - x) <= rel * np.abs(x) + 1e-30)
    else:
        scale = np.abs(x).max(axis=1, keepdims=True) / 127
        assert np.all(np.abs(y - x) <= scale / 2 * (1 + 1e-5))


floats = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(1, 40)), elements=floats))
def test_int8_error_at_most_half_a_scale(x):
    for name in ("int8", "int8-zstd"):
        c = get_codec(name)
        y = c.decode(c.encode(x), *x.shape)
        scale, _ = int8_quantize(x)
        bound = scale[:, None].astype(np.float64) / 2 * (1 + 1e-5) + 1e-37
        assert np.all(np.abs(y.astype(np.float64) - x) <= bound)


def test_bf16_rounds_to_nearest_even():
    # 1 + 2^-8 is halfway between bf16 1.0 and 1 + 2^-7: ties go to the even mantissa (1.0)
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5, np.inf, np.nan], dtype=np.float32)
    y = bf16_bits_to_f32(f32_to_bf16_bits(x))
    assert y[0] == 1.0 and y[1] == 1.0 and y[2] == 1 + 2 ** -6 and y[3] == -2.5 and np.isinf(y[4])
    assert np.isnan(y[5])


def test_default_codec_is_at_most_half_of_bf16_bytes():
    x = realistic(rows=3 * 256)
    rep = {r.codec: r for r in reconstruction_error(x)}
    assert rep[BASELINE_CODEC].bytes_ratio_vs_bf16 == 1.0
    assert rep[DEFAULT_CODEC].bytes_ratio_vs_bf16 <= 0.5
    assert rep["fp16"].rel_rms < rep["bf16"].rel_rms < rep["int8"].rel_rms < 0.05
    assert rep["int8"].max_abs == pytest.approx(rep["int8-zstd"].max_abs)


def test_unknown_codec_is_refused():
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("fp8")
    with pytest.raises(ValueError):
        get_codec("int8").encode(np.zeros(4, np.float32))
