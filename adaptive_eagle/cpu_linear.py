"""Fast CPU matmuls for bf16 checkpoints on CPUs without native bf16 (AVX2-class x86).

Owns: swapping a module's nn.Linear layers for FBGEMM fp16-weight / fp32-activation kernels, and making the
linears of the exact modes row-stable (a row's bits do not depend on how many rows its call holds).
Must not touch: what the model computes beyond rounding (every bf16 weight in fp16's normal range
is held exactly; activations and accumulation are fp32, i.e. more precise than bf16 compute).

Why. Without AVX512-BF16/AMX, PyTorch's bf16 GEMM is a generic kernel at a flat ~19 GFLOPS, so a
17-token verify forward costs ~8x a one-token step; fp32 GEMM scales well but reads twice the
bytes, so one-token decoding is ~1.75x slower than bf16. FBGEMM's fp16-weight kernel reads half
the bytes and computes in fp32 (measured on a 2-core AVX2 EPYC, 1536x576 weight: 0.055 ms at
1 row vs bf16 0.099; 0.335 ms at 17 rows vs bf16 1.63). Plain and speculative decoding then run
the same faster kernels, so speedups stay comparable.

Exact on every CPU kind (row stability). Greedy speculative output equals plain greedy only if a row's
result does not depend on how many rows the call holds: a verify forward multiplies q rows at once, plain
decoding one. Some kernels break that. Measured here (torch 2.13): FBGEMM's fp16 kernel is row-stable with its
AVX-512 kernels, but its AVX2 kernels (an AVX2-only EPYC, or FBGEMM_ENABLE_INSTRUCTIONS=AVX2) compute rows that
fall into 1- or 2-row blocks in another order (M = 1, 2, 7, 14, 31, 32, ... give other last bits than M = 3..6);
fp32's MKL/oneDNN GEMM gives M = 1, 2, 3, 5, 6, 7, 9, 10, 11 other bits than larger calls, on AVX-512 too.
So each kernel is probed once per process and weight shape (`stable_rows`: which row counts up to MAX_ROWS
compute every row as the common result), and a call whose row count is not one of them is padded to the next
one, or cut into chunks of the largest (`row_plan`). Where every count is stable (FBGEMM on AVX-512) calls go
straight through.

Both cores for verify (threaded rows). `fbgemm_linear_fp16_weight_fp32_activation` runs on one thread, and from
4 rows on it is compute-bound there (~90 GFLOP/s on one core of the 2-core EPYC): a 16-token verify forward
costs 3x a one-token step. The quantized engine's fp16 dynamic linear runs the same FBGEMM kernel split over
PyTorch's intra-op threads, and computes the same bits (checked at start, `threaded_fp16_available`, and for
every row count 1..48 at 1, 2 and 4 threads, on AVX-512 and FBGEMM's AVX2 kernels, in tests). It costs ~10 us more
a call, so a packed linear calls it from THREADED_ROWS rows on and the single-thread kernel below. Measured on
the 2-core EPYC (SmolLM2-135M forward over 120 cached tokens): 8 rows 40-42 -> 35-36 ms, 17 rows 68-70 -> 51-54;
1 and 2 rows unchanged. The price is a second packed copy of each weight (2 bytes a weight).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

_DEPRECATED = r"fbgemm_.* is deprecated"
# PyTorch marks these ops deprecated (their successor is torchao's packed fp16 path); silence that
# one warning once here rather than per call (a per-call catch_warnings cost ~2% of a decode step)
warnings.filterwarnings("ignore", message=_DEPRECATED, category=UserWarning)


@functools.cache
def fbgemm_fp16_available() -> bool:
    """Whether this PyTorch build has the FBGEMM fp16-weight linear (x86 builds do)."""
    try:
        packed = torch.fbgemm_pack_gemm_matrix_fp16(torch.randn(8, 16))
        y = torch.fbgemm_linear_fp16_weight_fp32_activation(torch.randn(2, 16), packed, torch.zeros(8))
        return bool(torch.allclose(y, y)) and y.shape == (2, 8)
    except (AttributeError, RuntimeError):
        return False


MAX_ROWS = 48  # row counts probed per kernel and shape: calls up to this size are padded, larger ones chunked
THREADED_ROWS = 4  # calls of this many rows and more run the threaded fp16 kernel where there are threads (doc)


def _fp16_threaded_pack(w: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.quantized.linear_prepack_fp16(w, bias)


@functools.cache
def threaded_fp16_available() -> bool:
    """Whether this build has the quantized engine's fp16 dynamic linear and it gives what the single-thread
    FBGEMM fp16 linear gives, bit for bit, bias included (a small case at every row count up to 8 here; tests
    check the model's shapes at every count up to MAX_ROWS). Where it is missing or differs, verify forwards run
    on one thread, with a warning saying why."""
    if not fbgemm_fp16_available():
        return False
    try:
        same = not threaded_differs(((40, 24),), (torch.get_num_threads(),), max_rows=8)
    except (AttributeError, RuntimeError) as e:
        warnings.warn(f"fp16-weight linears run on one thread: this PyTorch build has no usable quantized fp16 "
                      f"linear ({type(e).__name__}: {e}); multi-row verify forwards cost more", stacklevel=2)
        return False
    if not same:
        warnings.warn("fp16-weight linears run on one thread: the quantized fp16 linear's bits differ from the "
                      "single-thread FBGEMM linear's here, so mixing them would break greedy exactness", stacklevel=2)
    return same


def verify_threads(compute: str) -> int:
    """The threads a multi-row target forward computes its linears on, in this process, for a target running in
    `compute` (Target.compute): fp16-packed weights use PyTorch's intra-op threads only through the threaded
    kernel (one thread where it is missing or differs); every other mode uses them all. Shown in a replica's
    status and as ae_replica_verify_threads, so a fallback to one thread is seen, not only warned."""
    if compute.endswith("fp16-weights") and not threaded_fp16_available():
        return 1
    return torch.get_num_threads()


def threaded_differs(shapes, threads=(1, 2, 4), max_rows: int = MAX_ROWS, seed: int = 5) -> list[tuple]:
    """(out, in, threads, rows) at which the threaded fp16 kernel's bits differ from the single-thread kernel's,
    for random bf16-representable weights of each (out, in) shape, a random bias and every row count up to
    max_rows (empty: they agree everywhere asked)."""
    g, bad, prev = torch.Generator().manual_seed(seed), [], torch.get_num_threads()
    try:
        for n, k in shapes:
            w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16().float()
            bias, x = torch.randn(n, generator=g), torch.randn(max_rows, k, generator=g)
            packed, threaded = torch.fbgemm_pack_gemm_matrix_fp16(w), _fp16_threaded_pack(w, bias)
            for t in threads:
                torch.set_num_threads(t)
                for m in range(1, max_rows + 1):
                    one = torch.fbgemm_linear_fp16_weight_fp32_activation(x[:m], packed, bias)
                    if not torch.equal(one, torch.ops.quantized.linear_dynamic_fp16(x[:m], threaded)):
                        bad.append((n, k, t, m))
    finally:
        torch.set_num_threads(prev)
    return bad


def fp16_matmul(x: torch.Tensor, packed: torch.Tensor, threaded, bias: torch.Tensor) -> torch.Tensor:
    """x @ W.T + bias over FBGEMM fp16-packed W: the threaded kernel (`threaded`, or None) from THREADED_ROWS
    rows on when PyTorch has more than one thread, else the single-thread one (the same bits: module doc)."""
    if threaded is not None and x.shape[0] >= THREADED_ROWS and torch.get_num_threads() > 1:
        return torch.ops.quantized.linear_dynamic_fp16(x, threaded)
    return torch.fbgemm_linear_fp16_weight_fp32_activation(x, packed, bias)


@dataclass(frozen=True)
class StableRows:
    """The row counts (1..MAX_ROWS) at which a kernel computes every row exactly as its common result does."""

    sizes: tuple[int, ...]

    @property
    def all(self) -> bool:
        return len(self.sizes) == MAX_ROWS

    def plan(self, n: int) -> list[tuple[int, int, int]]:
        """(start, stop, size) calls that compute n rows: rows [start, stop) in a call of `size` rows (padded
        with zero rows past stop). Every size is a stable one."""
        return row_plan(n, self.sizes)


def row_plan(n: int, sizes: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Cut n rows into calls of stable sizes: n itself when stable, else padded up to the next stable size,
    else chunks of the largest stable size and a padded remainder. ValueError when no size is stable."""
    if not sizes:
        raise ValueError("no stable row count: this kernel's rows depend on the call's size at every size probed")
    out, start, big = [], 0, max(sizes)
    while n - start > big:
        out.append((start, start + big, big))
        start += big
    rest = n - start
    if rest:
        out.append((start, n, next(k for k in sizes if k >= rest)))
    return out


def _probe_rows(fn: Callable[[torch.Tensor], torch.Tensor], in_features: int, max_rows: int = MAX_ROWS,
                seed: int = 0) -> tuple[int, ...]:
    """Row counts 1..max_rows at which fn (rows -> rows) gives every row its common value: the value most
    calls holding that row agree on, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max_rows, in_features, generator=g)
    outs = {}  # m -> a digest per row (a wide output held 48 times over would take hundreds of MB)
    with torch.inference_mode():
        for m in range(1, max_rows + 1):
            y = fn(x[:m]).contiguous().numpy()
            outs[m] = [hashlib.blake2b(y[r].tobytes(), digest_size=16).digest() for r in range(m)]
    common = [Counter(outs[m][r] for m in range(r + 1, max_rows + 1)).most_common(1)[0][0] for r in range(max_rows)]
    return tuple(m for m in range(1, max_rows + 1) if all(outs[m][r] == common[r] for r in range(m)))


@functools.cache
def stable_rows(kernel: str, in_features: int, out_features: int, threads: int) -> StableRows:
    """Probe `kernel` ("fp16-packed": FBGEMM fp16 weights, fp32 activations; "fp32": F.linear) at this weight
    shape and thread count, once per process (random weights: the blocking that breaks stability depends on
    the shape, the instruction set and the threads, not on the values)."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).to(torch.bfloat16).float()
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if kernel == "fp16-packed":  # both kernels, as the packed linear calls them (fp16_matmul)
            packed, bias = torch.fbgemm_pack_gemm_matrix_fp16(w), torch.zeros(out_features)
            threaded = _fp16_threaded_pack(w, bias) if threaded_fp16_available() else None
            sizes = _probe_rows(lambda x: fp16_matmul(x, packed, threaded, bias), in_features)
        elif kernel == "fp32":
            sizes = _probe_rows(lambda x: F.linear(x, w), in_features)
        else:
            raise ValueError(f"kernel must be 'fp16-packed' or 'fp32', got {kernel!r}")
    finally:
        torch.set_num_threads(prev)
    return StableRows(sizes)


def _probe_now(kernel: str, in_features: int, out_features: int) -> None:
    """Probe a linear's shape when it is built (a model load, a head install), not at its first forward: there it
    would land inside a request's decoding (a fresh engine's first draft step took 240 ms instead of a few, probing the
    draft head's shapes on the 2-core EPYC). Cached per process; a forward under another thread count probes again."""
    stable_rows(kernel, in_features, out_features, torch.get_num_threads())


_RAW = threading.local()  # raw_rows(): this thread calls the kernels at any row count


@contextlib.contextmanager
def raw_rows():
    """Within it (this thread), linears call their kernels at the row count given, as plain PyTorch does: what a
    user's own decoding (HF generate()) runs, for benchmark baselines. Exactness does not hold inside."""
    prev = getattr(_RAW, "on", False)
    _RAW.on = True
    try:
        yield
    finally:
        _RAW.on = prev


def stable_apply(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: StableRows) -> torch.Tensor:
    """fn over the rows of x (2-D), in calls of stable sizes only: every row comes out as it would in any other
    call (a one-token decode step and a verify forward agree bit for bit). Padding costs where small calls are
    unstable: a one-row step padded to 3 rows took 23.7 ms instead of 18.7 ms for SmolLM2-135M with FBGEMM's AVX2
    kernels, padded to 4 rows in fp32 73 ms instead of 52 ms (1 thread, 2-core EPYC); verify forwards of 4 rows
    and more cost the same."""
    n = x.shape[0]
    if rows.all or (n <= MAX_ROWS and n in rows.sizes) or getattr(_RAW, "on", False):
        return fn(x)
    parts = []
    for start, stop, size in rows.plan(n):
        chunk = x[start:stop]
        if size > stop - start:
            chunk = torch.cat([chunk, chunk.new_zeros(size - (stop - start), x.shape[1])])
        parts.append(fn(chunk)[: stop - start])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class Fp16PackedLinear(nn.Module):
    """nn.Linear with its weight packed to fp16 for FBGEMM; takes and returns fp32 (CPU only). Packed twice where
    the threaded kernel exists: for one thread and for PyTorch's intra-op threads (module doc)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float().cpu()
        self._packed = torch.fbgemm_pack_gemm_matrix_fp16(w)  # opaque: not a parameter or buffer
        bias = linear.bias.detach().float().cpu() if linear.bias is not None else torch.zeros(self.out_features)
        self.register_buffer("bias", bias, persistent=False)
        self._threaded = _fp16_threaded_pack(w, bias) if threaded_fp16_available() else None
        _probe_now("fp16-packed", self.in_features, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = stable_rows("fp16-packed", self.in_features, self.out_features, torch.get_num_threads())
        y = stable_apply(self._matmul, x.reshape(-1, shape[-1]).float().contiguous(), rows)
        return y.reshape(*shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return fp16_matmul(x, self._packed, self._threaded, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, weight=fp16-packed"
                + (f", threaded from {THREADED_ROWS} rows" if self._threaded is not None else ""))


class StableLinear(nn.Module):
    """An fp32 nn.Linear whose rows do not depend on the call's row count (stable_apply over F.linear); holds
    the original module's weight and bias (CPU, inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        _probe_now("fp32", self.in_features, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = stable_rows("fp32", self.in_features, self.out_features, torch.get_num_threads())
        y = stable_apply(lambda z: F.linear(z, self.weight, self.bias), x.reshape(-1, shape[-1]).contiguous(), rows)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows=stable"


def _replace_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every nn.Linear under `module` with make(linear), in place; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
            count += 1
        else:
            count += _replace_linears(child, make)
    return count


def stabilize_linears(module: nn.Module) -> int:
    """Replace every fp32 nn.Linear under `module` with a StableLinear (in place; the weights are shared, tied
    ones stay tied); returns how many. For fp32 targets on CPU, whose GEMM is not row-stable (module doc)."""
    return _replace_linears(module, StableLinear)


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` (in place, CPU, inference only); returns how many.
    Tied weights stay intact for the other user (e.g. the input embedding keeps its own tensor)."""
    if not fbgemm_fp16_available():
        raise RuntimeError("this PyTorch build has no FBGEMM fp16 linear; load the target in bf16 or fp32")
    return _replace_linears(module, Fp16PackedLinear)
