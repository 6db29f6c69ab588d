"""The engine on the real SmolLM2-135M with the shipped head: lossless, and the head helps.

float32 so that a one-token forward and a tree forward give the same argmax (bf16 near-ties can
flip between the two kernels; that is numerical, not a correctness issue, and is counted by
bench/decode.py instead)."""

from pathlib import Path

import pytest
import torch

from adaptive_eagle.checkpoint import load_head
from adaptive_eagle.costmodel import PinnedCosts
from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
from adaptive_eagle.targets import load_target
from adaptive_eagle.trace import SamplingParams

SHIPPED = Path(__file__).resolve().parents[2] / "heads" / "smollm2-135m-english-v2"
PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "Write a haiku about autumn leaves.",
           "Explain what a hash table is to a beginner."]


@pytest.fixture(scope="module")
def fp32_setup():
    target = load_target("smollm2-135m", dtype=torch.float32)
    loaded = load_head(SHIPPED, target, dtype=torch.float32)
    return target, loaded.head, loaded.meta.version


@pytest.mark.slow
@pytest.mark.parametrize("tree", [dict(depth=4, topk=1, num_draft_tokens=4), dict(depth=5, topk=4, num_draft_tokens=16)])
def test_smollm2_greedy_equals_plain(fp32_setup, tree):
    target, head, version = fp32_setup
    # flat pinned costs: every tree is verified whole, on any machine and under any load (a loaded CPU's
    # timings prune trees, and the acceptance figure below would measure the load, not the head)
    spec = SpeculativeEngine(target, head, EngineConfig(**tree, calibration_dir="", pinned_costs=PinnedCosts.flat()),
                             head_version=version)
    plain = SpeculativeEngine(target, None, EngineConfig.plain())
    sp = SamplingParams(max_tokens=40)
    steps = tokens = 0
    for p in PROMPTS:
        a, b = spec.generate(p, sp), plain.generate(p, sp)
        assert a.token_ids == b.token_ids, (p, a.text, b.text)
        steps += len(a.steps)
        tokens += len(a.token_ids)
        assert a.trace.head_version == version
    assert tokens / max(1, steps) > 1.1  # the shipped head gets drafts accepted


JSON_FORMATS = [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": {
        "type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["city", "country", "population"], "additionalProperties": False}}},
    {"type": "json_schema", "json_schema": {"name": "review", "schema": {
        "type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                         "score": {"type": "number"}, "tags": {"type": "array",
                                                                               "items": {"type": "string"}}},
        "required": ["sentiment", "score"]}}},
]
JSON_PROMPTS = ["Give me a JSON object describing Paris.", "Describe Tokyo as JSON.",
                "Review this movie as JSON: a slow but beautiful film about the sea.",
                "Return JSON about the city of Lagos.", "Summarise as JSON: the product broke after two days.",
                "Output a JSON record for Berlin, Germany.", "JSON please: a short review of a great pizza place.",
                "Give a JSON description of Sydney."]


@pytest.mark.slow
def test_smollm2_constrained_greedy_equals_constrained_plain_and_parses(fp32_setup):
    """The real tokenizer (byte-level BPE) under a grammar: 9 prompt x format pairs (make test's time budget; the
    64-pair check runs on a tiny model in test_grammar.py, and 24 pairs at 48 tokens passed here once), speculative
    == plain token for token, and every answer that ended parses as JSON of its format (most run past 40
    tokens: that 24-pair run closed 7)."""
    import json

    import jsonschema

    target, head, version = fp32_setup
    spec = SpeculativeEngine(target, head, EngineConfig(calibration_dir="", pinned_costs=PinnedCosts.flat()),
                             head_version=version)
    plain = SpeculativeEngine(target, None, EngineConfig.plain())
    sp = SamplingParams(max_tokens=40)
    steps = tokens = ended = 0
    for fmt in JSON_FORMATS:
        g_spec, g_plain = spec.grammar(fmt), plain.grammar(fmt)
        for p in JSON_PROMPTS[:3]:
            a, b = spec.generate(p, sp, grammar=g_spec), plain.generate(p, sp, grammar=g_plain)
            assert a.token_ids == b.token_ids, (fmt, p, a.text, b.text)
            steps, tokens = steps + len(a.steps), tokens + len(a.token_ids)
            if a.finish_reason == "stop":
                ended += 1
                value = json.loads(a.text)
                schema = fmt.get("json_schema", {}).get("schema", {"type": "object"})
                jsonschema.validate(value, schema)
    assert ended >= 1  # the parse check ran
    assert tokens / max(1, steps) > 1.1  # drafts inside the grammar are accepted
