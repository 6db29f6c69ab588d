"""Hidden-state codecs: float32 rows <-> compact bytes. Pure NumPy (+ zstandard for `-zstd`).

Owns: the codec registry (by name), the byte layouts, and a pure reconstruction-error report.
Must not touch: models, I/O, Arrow (schema.py stores the bytes and the codec name).

Layouts (little-endian, `rows x cols` known from the schema):
- `bf16`: upper 16 bits of each float32, round-to-nearest-even (the baseline).
- `fp16`: IEEE half (values beyond +-65504 become inf).
- `int8`: `rows` float32 scales, then `rows x cols` int8; x ~= q * scale, scale = max|row| / 127,
  so |x - x_hat| <= scale / 2 per element. One outlier channel sets the scale of its whole row.
- `int8b`: block-wise int8, one scale per block of `INT8_BLOCK` (64) channels of a row: `rows x
  ceil(cols / 64)` float16 scales (row-major; block k covers channels [64k, 64k + 64), the last
  may be shorter), then `rows x cols` int8; x ~= q * scale (symmetric, round-to-nearest). scale =
  max|block| / 127 rounded *up* to float16, so no value clips and |x - x_hat| <= scale / 2; it
  saturates at the float16 maximum (|x| beyond 127 * 65504 clips). Non-finite inputs are
  unsupported (as for `int8`).
- `<name>-zstd`: zstd (level 3) over the layout above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

ZSTD_LEVEL = 3


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bf16 bits, round-to-nearest-even; NaN stays a (quiet) NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (((u >> 16) & 1) + np.uint32(0x7FFF))) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def _bf16_encode(x: np.ndarray) -> bytes:
    return f32_to_bf16_bits(x).tobytes()


def _bf16_decode(buf: bytes, rows: int, cols: int) -> np.ndarray:
    return bf16_bits_to_f32(np.frombuffer(buf, dtype="<u2").reshape(rows, cols))


def _fp16_encode(x: np.ndarray) -> bytes:
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(x, dtype="<f2").tobytes()


def _fp16_decode(buf: bytes, rows: int, cols: int) -> np.ndarray:
    return np.frombuffer(buf, dtype="<f2").reshape(rows, cols).astype(np.float32)


def int8_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row absmax int8. x [rows, cols] float32 -> (scales [rows] float32, q [rows, cols] int8)."""
    x = np.asarray(x, dtype=np.float32)
    amax = np.max(np.abs(x), axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    scale = (amax / np.float32(127.0)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    q = np.clip(np.rint(x / safe[:, None]), -127, 127).astype(np.int8)
    return scale, q


def _int8_encode(x: np.ndarray) -> bytes:
    scale, q = int8_quantize(x)
    return scale.astype("<f4").tobytes() + q.tobytes()


def _int8_decode(buf: bytes, rows: int, cols: int) -> np.ndarray:
    scale = np.frombuffer(buf, dtype="<f4", count=rows)
    q = np.frombuffer(buf, dtype=np.int8, offset=4 * rows).reshape(rows, cols)
    return q.astype(np.float32) * scale[:, None]


INT8_BLOCK = 64  # channels per scale in `int8b` (part of its byte layout: never change it)
_FP16_MAX = np.float16(np.finfo(np.float16).max)


def _blocks(a: np.ndarray, block: int) -> np.ndarray:
    """[rows, cols] -> [rows, ceil(cols / block), block]; a tail block is zero-padded (a copy), else a view."""
    rows, cols = a.shape
    nb = -(-cols // block)
    if nb * block != cols:
        a = np.pad(a, ((0, 0), (0, nb * block - cols)))
    return a.reshape(rows, nb, block)


def int8b_quantize(x: np.ndarray, block: int = INT8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Block-wise absmax int8. x [rows, cols] float32 -> (scales [rows, ceil(cols / block)] float16,
    q [rows, cols] int8). Each scale is max|block| / 127 rounded up to float16, so |x| / scale <= 127."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    xb = _blocks(x, block)  # [rows, nb, block]
    exact = np.abs(xb).max(axis=2, initial=0.0).astype(np.float64) / 127.0  # [rows, nb]; float64: no underflow
    scale = np.minimum(exact, np.float64(_FP16_MAX)).astype(np.float16)
    low = (scale.astype(np.float64) < exact) & (scale < _FP16_MAX)
    scale[low] = np.nextafter(scale[low], np.float16(np.inf))
    safe = scale.astype(np.float32)
    safe[safe == 0] = 1.0
    q = np.clip(np.rint(xb / safe[:, :, None]), -127, 127).astype(np.int8)
    return scale, np.ascontiguousarray(q.reshape(rows, -1)[:, :cols])


def _int8b_encode(x: np.ndarray) -> bytes:
    scale, q = int8b_quantize(x)
    return scale.astype("<f2").tobytes() + q.tobytes()


def _int8b_decode(buf: bytes, rows: int, cols: int) -> np.ndarray:
    nb = -(-cols // INT8_BLOCK)
    scale = np.frombuffer(buf, dtype="<f2", count=rows * nb).reshape(rows, nb).astype(np.float32)
    q = np.frombuffer(buf, dtype=np.int8, offset=2 * rows * nb).reshape(rows, cols)
    y = _blocks(q, INT8_BLOCK).astype(np.float32) * scale[:, :, None]  # [rows, nb, block]
    return y.reshape(rows, -1)[:, :cols]


@dataclass(frozen=True)
class Codec:
    name: str
    encode_fn: Callable[[np.ndarray], bytes]
    decode_fn: Callable[[bytes, int, int], np.ndarray]
    zstd: bool = False

    def encode(self, x: np.ndarray) -> bytes:
        """x: [rows, cols] float32 -> bytes."""
        if x.ndim != 2:
            raise ValueError(f"codec {self.name} expects [rows, cols], got shape {x.shape}")
        raw = self.encode_fn(np.asarray(x, dtype=np.float32))
        if self.zstd:
            import zstandard

            return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
        return raw

    def decode(self, buf: bytes, rows: int, cols: int) -> np.ndarray:
        """bytes -> [rows, cols] float32 (a fresh, writable array)."""
        if self.zstd:
            import zstandard

            buf = zstandard.ZstdDecompressor().decompress(buf)
        return np.array(self.decode_fn(bytes(buf), rows, cols), dtype=np.float32)


def _build_registry() -> dict[str, Codec]:
    base = {"bf16": (_bf16_encode, _bf16_decode), "fp16": (_fp16_encode, _fp16_decode),
            "int8": (_int8_encode, _int8_decode), "int8b": (_int8b_encode, _int8b_decode)}
    reg: dict[str, Codec] = {}
    for name, (enc, dec) in base.items():
        reg[name] = Codec(name, enc, dec)
        reg[f"{name}-zstd"] = Codec(f"{name}-zstd", enc, dec, zstd=True)
    return reg


CODECS: dict[str, Codec] = _build_registry()
DEFAULT_CODEC = "int8b-zstd"  # the most accurate codec within 50% of bf16 bytes (bench/store.py measures it)
BASELINE_CODEC = "bf16"


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known: {sorted(CODECS)}") from None


@dataclass(frozen=True)
class CodecError:
    codec: str
    bytes: int
    bytes_ratio_vs_bf16: float  # this codec's bytes / bf16 bytes
    rel_rms: float  # ||x - x_hat||_2 / ||x||_2
    max_abs: float  # max |x - x_hat|


def reconstruction_error(x: np.ndarray, codecs: list[str] | None = None) -> list[CodecError]:
    """Per-codec size and reconstruction error on x [rows, cols] float32 (a pure function).

    The bar in the design is <= 1% accept-length loss of a trained head for the default codec; that
    needs a trained head and the engine and is measured there. This reports the codec side."""
    x = np.asarray(x, dtype=np.float32)
    base = len(CODECS[BASELINE_CODEC].encode(x))
    norm = float(np.linalg.norm(x.astype(np.float64))) or 1.0
    out = []
    for name in codecs or sorted(CODECS):
        c = get_codec(name)
        buf = c.encode(x)
        err = np.abs(c.decode(buf, *x.shape).astype(np.float64) - x)
        finite = np.isfinite(err)
        out.append(CodecError(name, len(buf), len(buf) / max(base, 1),
                              float(np.linalg.norm(err[finite])) / norm if finite.all() else float("inf"),
                              float(err.max()) if err.size else 0.0))
    return out
