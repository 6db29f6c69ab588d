"""Codecs: round-trip error bounds (property-tested for int8 and int8b), bf16 rounding, sizes, frozen byte
layouts, registry."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from feature_store.codecs import (BASELINE_CODEC, CODECS, DEFAULT_CODEC, INT8_BLOCK, bf16_bits_to_f32,
                                  f32_to_bf16_bits, get_codec, int8_quantize, int8b_quantize, reconstruction_error)


def realistic(rows=64, cols=576, seed=0):
    """Gaussian rows with a few large outlier channels, like transformer residual streams."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.5, 4, (rows, 1)).astype(np.float32)
    x[:, [3, 77, 400]] *= 40
    return x


def smollm2_aux(tokens=256, seed=0):  # [tokens * 3, 576]: rows as schema.py encodes them
    """SmolLM2-shaped aux hidden states as bench/store.py makes them: 3 aux layers x 576 channels per
    token, Gaussian with per-layer and per-token scales and three massive-activation channels."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, 3, 576)).astype(np.float32)
    x *= np.array([0.6, 2.0, 6.0], np.float32)[None, :, None] * rng.uniform(0.7, 1.4, (tokens, 1, 1)).astype(np.float32)
    x[:, :, [5, 131, 402]] *= 30.0
    return x.reshape(tokens * 3, 576)


def int8b_bound(x):  # [rows, cols] float64: the worst per-element error int8b may make on x
    """Half the exact block scale max|block| / 127, plus the slack of rounding it up to float16 (one
    ulp: relative 2^-10 for normal float16, absolute 2^-24 below), plus float32 arithmetic slack."""
    rows, cols = x.shape
    nb = -(-cols // INT8_BLOCK)
    a = np.zeros((rows, nb * INT8_BLOCK))
    a[:, :cols] = np.abs(x.astype(np.float64))
    exact = np.repeat(a.reshape(rows, nb, INT8_BLOCK).max(axis=2) / 127, INT8_BLOCK, axis=1)[:, :cols]
    return (exact * (1 + 2 ** -10) + 2 ** -24) / 2 * (1 + 1e-6)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_round_trip_shape_and_bound(name):
    x = realistic()
    c = get_codec(name)
    y = c.decode(c.encode(x), *x.shape)
    assert y.shape == x.shape and y.dtype == np.float32
    rel = {"bf16": 2 ** -8, "fp16": 2 ** -11, "int8": None, "int8b": None}[name.split("-")[0]]
    if rel is not None:
        assert np.all(np.abs(y - x) <= rel * np.abs(x) + 1e-30)
    elif name.startswith("int8b"):
        assert np.all(np.abs(y.astype(np.float64) - x) <= int8b_bound(x))
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


@settings(max_examples=300, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(1, 3 * INT8_BLOCK + 7)), elements=floats))
def test_int8b_error_at_most_half_a_block_scale(x):
    """Any row length (tail blocks included): shape and dtype survive, every element is within half
    its block's stored scale, and that scale is max|block| / 127 up to float16 rounding."""
    scale, q = int8b_quantize(x)
    nb = -(-x.shape[1] // INT8_BLOCK)
    assert scale.shape == (x.shape[0], nb) and scale.dtype == np.float16 and q.shape == x.shape
    stored = np.repeat(scale.astype(np.float64), INT8_BLOCK, axis=1)[:, :x.shape[1]]
    outs = []
    for name in ("int8b", "int8b-zstd"):
        c = get_codec(name)
        buf = c.encode(x)
        y = c.decode(buf, *x.shape)
        assert y.shape == x.shape and y.dtype == np.float32 and y.flags.writeable
        err = np.abs(y.astype(np.float64) - x)
        assert np.all(err <= stored / 2 * (1 + 1e-6) + 1e-45)
        assert np.all(err <= int8b_bound(x))
        outs.append(y)
    assert len(get_codec("int8b").encode(x)) == x.shape[0] * (2 * nb + x.shape[1])
    np.testing.assert_array_equal(outs[0], outs[1])  # zstd is lossless on top


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(8, 256))
def test_int8b_zstd_is_at_most_half_of_bf16_bytes_on_smollm2_shapes(seed, tokens):
    x = smollm2_aux(tokens, seed)
    assert len(get_codec("int8b-zstd").encode(x)) <= 0.5 * len(get_codec("bf16").encode(x))


def test_int8b_beats_int8_on_outlier_rows():
    rep = {r.codec: r for r in reconstruction_error(smollm2_aux(), ["bf16", "int8", "int8b"])}
    assert rep["bf16"].rel_rms < rep["int8b"].rel_rms < rep["int8"].rel_rms / 2


# Byte layouts are frozen: stored records name their codec, so a layout may never change under a name.
GOLDEN_X = np.array([[1.0, -2.5, 0.0], [300.0, 0.125, -7.0]], np.float32)
GOLDEN = {
    "bf16": ("803f20c000009643003ee0c0", [[1.0, -2.5, 0.0], [300.0, 0.125, -7.0]]),
    "fp16": ("003c00c10000b05c003000c7", [[1.0, -2.5, 0.0], [300.0, 0.125, -7.0]]),
    "int8": ("8542a13c5d2e17403381007f00fd", [[1.003937005996704, -2.5, 0.0], [300.0, 0.0, -7.086614608764648]]),
    "int8b": ("0b25ba403381007f00fd", [[1.0046539306640625, -2.5017852783203125, 0.0],
                                       [300.13671875, 0.0, -7.08984375]]),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_byte_layouts_are_frozen(name):
    hex_bytes, values = GOLDEN[name]
    assert get_codec(name).encode(GOLDEN_X).hex() == hex_bytes
    np.testing.assert_array_equal(get_codec(name).decode(bytes.fromhex(hex_bytes), 2, 3), np.float32(values))
    z = get_codec(f"{name}-zstd")
    np.testing.assert_array_equal(z.decode(z.encode(GOLDEN_X), 2, 3), np.float32(values))


def test_bf16_rounds_to_nearest_even():
    # 1 + 2^-8 is halfway between bf16 1.0 and 1 + 2^-7: ties go to the even mantissa (1.0)
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5, np.inf, np.nan], dtype=np.float32)
    y = bf16_bits_to_f32(f32_to_bf16_bits(x))
    assert y[0] == 1.0 and y[1] == 1.0 and y[2] == 1 + 2 ** -6 and y[3] == -2.5 and np.isinf(y[4])
    assert np.isnan(y[5])


@pytest.mark.parametrize("x", [realistic(rows=3 * 256), smollm2_aux()], ids=["realistic", "smollm2"])
def test_default_codec_is_the_most_accurate_within_half_of_bf16_bytes(x):
    rep = {r.codec: r for r in reconstruction_error(x)}
    assert rep[BASELINE_CODEC].bytes_ratio_vs_bf16 == 1.0
    assert rep[DEFAULT_CODEC].bytes_ratio_vs_bf16 <= 0.5
    assert rep["fp16"].rel_rms < rep["bf16"].rel_rms < rep["int8b"].rel_rms < rep["int8"].rel_rms < 0.05
    assert rep["int8"].max_abs == pytest.approx(rep["int8-zstd"].max_abs)
    within = [r for r in rep.values() if r.bytes_ratio_vs_bf16 <= 0.5]
    assert rep[DEFAULT_CODEC].rel_rms == min(r.rel_rms for r in within)


def test_unknown_codec_is_refused():
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("fp8")
    with pytest.raises(ValueError):
        get_codec("int8").encode(np.zeros(4, np.float32))
