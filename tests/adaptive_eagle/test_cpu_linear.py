"""The fp16-packed CPU linear computes what nn.Linear computes over the same (bf16-valued) weights,
and the engine stays lossless on a packed target."""

import pytest
import torch
from torch import nn

from adaptive_eagle.cpu_linear import Fp16PackedLinear, pack_linears
from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
from adaptive_eagle.targets import default_dtype, tiny_target
from adaptive_eagle.trace import SamplingParams


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_packed_linear_matches_fp32_linear_over_bf16_weights(rows):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.bfloat16().float())  # bf16 values: fp16 holds them exactly
    packed = Fp16PackedLinear(lin)
    x = torch.randn(2, rows, 96)
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    assert packed(x).shape == (2, rows, 40)


def test_pack_linears_keeps_the_model_and_tied_embeddings():
    target = tiny_target(seed=3, dtype=torch.float32)
    with torch.no_grad():
        for p in target.model.parameters():
            p.copy_(p.bfloat16().float())
    ids = torch.randint(0, target.config.vocab_size, (1, 12))
    want = target.model(ids).logits
    embed = target.input_embeddings().clone()
    assert pack_linears(target.model) == 6 * 7 + 1  # q k v o gate up down per layer + lm_head
    torch.testing.assert_close(target.model(ids).logits, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(target.output_embeddings(), embed)  # the tied LM head reads as the embedding


def test_engine_is_lossless_on_a_packed_target():
    from tests.adaptive_eagle.test_engine import plain_greedy, tiny_setup

    target, head = tiny_setup(seed=5, dtype=torch.float32)
    pack_linears(target.model)
    target.compute = "float32+fp16-weights"
    engine = SpeculativeEngine(target, head, EngineConfig(depth=4, topk=3, num_draft_tokens=10, cost_aware=False))
    assert not any(isinstance(m, nn.Linear) for m in engine.head.modules())  # the head is packed too
    assert any(isinstance(m, nn.Linear) for m in head.modules())  # ... as a copy: the caller's head is untouched
    engine.eos_ids = set()
    plain = SpeculativeEngine(target, None, EngineConfig(prompt_lookup=False))
    plain.eos_ids = set()
    for prompt in ([3, 9, 4, 1], [7] * 6, [11, 2, 30, 5, 8]):
        got = engine.generate(prompt, SamplingParams(max_tokens=24)).token_ids
        assert got == plain.generate(prompt, SamplingParams(max_tokens=24)).token_ids


def test_dtype_policy(monkeypatch):
    monkeypatch.setenv("ADAPTIVE_EAGLE_DTYPE", "fp32")
    assert default_dtype("cpu", "decode") == torch.float32
    monkeypatch.setenv("ADAPTIVE_EAGLE_DTYPE", "nonsense")
    with pytest.raises(ValueError, match="unknown dtype"):
        default_dtype("cpu")
    monkeypatch.delenv("ADAPTIVE_EAGLE_DTYPE")
    assert default_dtype("cpu", "decode") == torch.bfloat16
    with pytest.raises(ValueError, match="purpose"):
        default_dtype("cpu", "serve")
