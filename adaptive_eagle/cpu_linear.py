"""Fast CPU matmuls for bf16 checkpoints on CPUs without native bf16 (AVX2-class x86).

Owns: swapping a module's nn.Linear layers for FBGEMM fp16-weight / fp32-activation kernels.
Must not touch: what the model computes beyond rounding (every bf16 weight in fp16's normal range
is held exactly; activations and accumulation are fp32, i.e. more precise than bf16 compute).

Why. Without AVX512-BF16/AMX, PyTorch's bf16 GEMM is a generic kernel at a flat ~19 GFLOPS, so a
17-token verify forward costs ~8x a one-token step; fp32 GEMM scales well but reads twice the
bytes, so one-token decoding is ~1.75x slower than bf16. FBGEMM's fp16-weight kernel reads half
the bytes and computes in fp32 (measured on a 2-core AVX2 EPYC, 1536x576 weight: 0.055 ms at
1 row vs bf16 0.099; 0.335 ms at 17 rows vs bf16 1.63). Plain and speculative decoding then run
the same faster kernels, so speedups stay comparable.
"""

from __future__ import annotations

import functools
import warnings

import torch
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


class Fp16PackedLinear(nn.Module):
    """nn.Linear with its weight packed to fp16 for FBGEMM; takes and returns fp32 (CPU only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float().cpu()
        self._packed = torch.fbgemm_pack_gemm_matrix_fp16(w)  # opaque: not a parameter or buffer
        bias = linear.bias.detach().float().cpu() if linear.bias is not None else torch.zeros(self.out_features)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.fbgemm_linear_fp16_weight_fp32_activation(
            x.reshape(-1, shape[-1]).float().contiguous(), self._packed, self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=fp16-packed"


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` (in place, CPU, inference only); returns how many.
    Tied weights stay intact for the other user (e.g. the input embedding keeps its own tensor)."""
    if not fbgemm_fp16_available():
        raise RuntimeError("this PyTorch build has no FBGEMM fp16 linear; load the target in bf16 or fp32")
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Fp16PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count
