"""Exact on every CPU kind: a row's result may not depend on how many rows its call holds (a verify forward
multiplies q rows at once, plain decoding one). FBGEMM's AVX2 fp16 kernels and CPU fp32 GEMM break that; the
linears of the exact modes call them only at row counts probed stable (adaptive_eagle/cpu_linear.py), and
compute-mode measurement checks every linear of the model on the machine (compute.rows_stable) and records the
verify residual attention leaves (compute.verify_logit_diff).

The AVX2 cases run in a subprocess with FBGEMM_ENABLE_INSTRUCTIONS=AVX2 (FBGEMM's own switch; on an AVX2-only
CPU it changes nothing): a 2-core AMD EPYC with AVX2 only served a greedy response that differed from plain
decoding in fp32+fp16-weights mode, while every development machine had AVX-512."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from adaptive_eagle import cpu_linear
from adaptive_eagle.cpu_linear import (MAX_ROWS, THREADED_ROWS, Fp16PackedLinear, StableRows, _probe_rows, raw_rows,
                                       row_plan, stable_apply, stable_rows, stabilize_linears)
from adaptive_eagle.compute import rows_stable, verify_logit_diff
from adaptive_eagle.targets import tiny_target

REPO = Path(__file__).resolve().parents[2]


def test_row_plan_pads_to_the_next_stable_size_and_chunks_beyond_the_largest():
    sizes = (3, 4, 5, 6, 8, 9, 12)
    assert row_plan(1, sizes) == [(0, 1, 3)]
    assert row_plan(6, sizes) == [(0, 6, 6)]
    assert row_plan(7, sizes) == [(0, 7, 8)]
    assert row_plan(30, sizes) == [(0, 12, 12), (12, 24, 12), (24, 30, 6)]
    assert row_plan(25, sizes) == [(0, 12, 12), (12, 24, 12), (24, 25, 3)]
    with pytest.raises(ValueError, match="no stable row count"):
        row_plan(4, ())


def _unstable_kernel(w: torch.Tensor):
    """A kernel like FBGEMM's AVX2 one: calls of 1 or 2 rows (and the last row of 7-row calls) come out one ulp
    off the common result. The common result is float64 math cast to fp32, so it does not depend on the call's
    size itself (fp32 GEMM here does: cpu_linear.py)."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = (x.double() @ w.double().T).float()
        other = torch.nextafter(y, torch.full_like(y, float("inf")))
        m = x.shape[0]
        if m <= 2:
            return other
        if m == 7:
            y[-1] = other[-1]
        return y
    return fn


def test_a_kernel_whose_rows_depend_on_the_call_size_is_found_and_made_stable():
    torch.manual_seed(0)
    w = torch.randn(40, 64)
    fn = _unstable_kernel(w)
    sizes = _probe_rows(fn, 64)
    assert 1 not in sizes and 2 not in sizes and 7 not in sizes and {3, 4, 6, 8, MAX_ROWS} <= set(sizes)
    rows = StableRows(sizes)
    x = torch.randn(100, 64)
    whole = stable_apply(fn, x, rows)
    assert not torch.equal(fn(x[:1])[0], whole[0])  # the raw kernel: one row alone differs
    for m in (1, 2, 7, 13, 48, 49, 100):
        assert torch.equal(stable_apply(fn, x[:m], rows), whole[:m]), m
    with raw_rows():  # a baseline's own decoding: the kernel as called
        assert torch.equal(stable_apply(fn, x[:1], rows), fn(x[:1]))


def test_fp32_linears_are_row_stable_once_stabilized_and_the_model_check_sees_it():
    target = tiny_target(seed=2, dtype=torch.float32)
    # CPU fp32 GEMM: the check finds rows that depend on the call's size (module doc of cpu_linear.py)
    assert not rows_stable(target.model) or stable_rows("fp32", 64, 64, torch.get_num_threads()).all
    assert stabilize_linears(target.model) == 6 * 7 + 1
    lin = target.model.model.layers[0].mlp.up_proj
    x = torch.randn(40, lin.in_features)
    with torch.inference_mode():
        whole = lin(x)
        assert all(torch.equal(lin(x[m:m + 1])[0], whole[m]) for m in range(40))
    assert rows_stable(target.model)
    # attention's residual: small, recorded, not claimed to be 0
    assert 0 <= verify_logit_diff(target.model) < 1e-4


def test_a_stable_rows_probe_is_made_once_per_kernel_shape_and_thread_count():
    stable_rows.cache_clear()
    a = stable_rows("fp32", 32, 24, torch.get_num_threads())
    assert stable_rows("fp32", 32, 24, torch.get_num_threads()) is a
    assert stable_rows.cache_info().hits == 1
    with pytest.raises(ValueError, match="kernel must be"):
        stable_rows("bf16", 32, 24, 1)



def test_a_linear_is_probed_when_it_is_built_not_in_its_first_forward():
    """The probe would otherwise land inside a request: a fresh engine's first draft step took 240 ms instead of
    ~5 ms, probing the draft head's shapes (2-core EPYC)."""
    from adaptive_eagle.cpu_linear import Fp16PackedLinear, StableLinear, fbgemm_fp16_available

    kinds = [StableLinear] + ([Fp16PackedLinear] if fbgemm_fp16_available() else [])
    for make in kinds:
        stable_rows.cache_clear()
        lin = make(torch.nn.Linear(40, 24))
        assert stable_rows.cache_info().misses == 1, make  # probed at construction
        with torch.inference_mode():
            lin(torch.randn(3, 40))
        assert stable_rows.cache_info().misses == 1 and stable_rows.cache_info().hits >= 1, make

MODEL_SHAPES = ((192, 576), (576, 576), (1536, 576), (576, 1536), (49152, 576))  # SmolLM2-135M's linears


def test_the_threaded_fp16_kernel_gives_the_single_thread_kernels_bits_and_serves_verify_sized_calls(monkeypatch):
    """Verify forwards (THREADED_ROWS rows and more) run FBGEMM's fp16 kernel over both cores, plain decoding's
    one-row steps the single-thread call: greedy stays exact only if both give the same bits at every row count
    and thread count (1, 2 and 4 threads, as prod.yaml gives a replica; the AVX2 kernels: the subprocess test below)."""
    assert cpu_linear.threaded_fp16_available()  # x86 PyTorch builds have it: losing it loses verify's second core
    assert cpu_linear.threaded_differs(MODEL_SHAPES) == []
    lin = Fp16PackedLinear(torch.nn.Linear(64, 96).bfloat16())
    called = []
    real = cpu_linear.fp16_matmul
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch.ops.quantized, "linear_dynamic_fp16",
                        lambda x, w: called.append(x.shape[0]) or torch.zeros(x.shape[0], 96))
    for m in (1, THREADED_ROWS - 1, THREADED_ROWS, 17):
        real(torch.randn(m, 64), lin._packed, lin._threaded, lin.bias)
    assert called == [THREADED_ROWS, 17]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # one thread: the single-thread kernel only
    real(torch.randn(17, 64), lin._packed, lin._threaded, lin.bias)
    assert called == [THREADED_ROWS, 17]


def test_a_threaded_kernel_with_other_bits_is_refused_loudly(monkeypatch):
    real = torch.ops.quantized.linear_dynamic_fp16
    monkeypatch.setattr(torch.ops.quantized, "linear_dynamic_fp16",
                        lambda x, w: torch.nextafter(real(x, w), torch.tensor(float("inf"))))
    cpu_linear.threaded_fp16_available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="bits differ"):
            assert not cpu_linear.threaded_fp16_available()
        assert Fp16PackedLinear(torch.nn.Linear(64, 96))._threaded is None  # the single-thread kernel only
        # a replica shows it (status, ae_replica_verify_threads): fp16 weights fall back to one thread, others not
        monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
        assert cpu_linear.verify_threads("float32+fp16-weights") == 1
        assert cpu_linear.verify_threads("bfloat16") == 4
    finally:
        monkeypatch.undo()
        cpu_linear.threaded_fp16_available.cache_clear()
    assert cpu_linear.threaded_fp16_available()
    assert cpu_linear.verify_threads("float32+fp16-weights") == torch.get_num_threads()


AVX2_PROBE = textwrap.dedent("""
    import json, torch
    from adaptive_eagle import cpu_linear
    from adaptive_eagle.compute import rows_stable
    from adaptive_eagle.cpu_linear import Fp16PackedLinear, pack_linears
    from adaptive_eagle.targets import tiny_target
    torch.manual_seed(0)
    lin = torch.nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    packed = Fp16PackedLinear(lin)
    x = torch.randn(40, 576)
    raw = lambda z: torch.fbgemm_linear_fp16_weight_fp32_activation(z, packed._packed, packed.bias)
    with torch.inference_mode():
        whole = packed(x)
        out = {"raw_one_row_differs": not torch.equal(raw(x[:1])[0], raw(x[:6])[0]),
               "packed_rows_equal": all(torch.equal(packed(x[:m]), whole[:m]) for m in range(1, 41)),
               "stable_sizes": list(cpu_linear.stable_rows("fp16-packed", 576, 1536, torch.get_num_threads()).sizes)}
    target = tiny_target(seed=4, dtype=torch.float32, hidden_size=256, intermediate_size=640)
    with torch.no_grad():
        for p in target.model.parameters():
            p.copy_(p.bfloat16().float())
    pack_linears(target.model)
    out["model_rows_stable"] = rows_stable(target.model)
    cpu_linear.stable_rows.cache_clear()
    everything = cpu_linear.StableRows(tuple(range(1, cpu_linear.MAX_ROWS + 1)))
    cpu_linear.stable_rows = lambda *a: everything  # the raw kernels, as before rows were made stable
    out["model_rows_stable_raw"] = rows_stable(target.model)
    out["threaded_differs"] = cpu_linear.threaded_differs(((192, 576), (1536, 576), (576, 1536), (4096, 576)))
    print(json.dumps(out))
""")


def test_fbgemm_avx2_kernels_are_row_stable_through_the_packed_linear_and_the_model_check_can_fail():
    env = {**os.environ, "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
           "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", AVX2_PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["raw_one_row_differs"], out  # the failure: FBGEMM's AVX2 kernel, one row vs six
    assert 1 not in out["stable_sizes"], out
    assert out["packed_rows_equal"], out
    assert out["model_rows_stable"], out
    assert not out["model_rows_stable_raw"], out  # the check sees the raw kernels' difference
    assert out["threaded_differs"] == [], out  # the threaded kernel keeps the AVX2 kernels' bits too
