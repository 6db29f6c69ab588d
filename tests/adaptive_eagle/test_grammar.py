"""Constrained decoding under speculation (grammar.py): constrained speculative greedy output equals constrained
plain greedy output token for token, every output is inside the grammar, drafts outside it are pruned, and
constrained sampling keeps the constrained target distribution (a statistical test against the exact one).

The tiny target here has a character vocabulary (JSON's punctuation, digits, letters), so a random model can
write JSON under a grammar; float64, so speculative and plain logits agree exactly."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

from adaptive_eagle.engine import EMPTY_TREE, EngineConfig, SpeculativeEngine
from adaptive_eagle.grammar import GrammarError
from adaptive_eagle.targets import tiny_target
from adaptive_eagle.trace import SamplingParams
from tests.serving.conftest import tiny_head

CHARS = list('{}[]":, 0123456789abcdefghijklmnopqrstuvwxyz.-\n') + list("<>/_") + list("ABCDEFGHIJKL")
VOCAB = 3 + len(CHARS)
SCHEMAS = [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "item", "strict": True, "schema": {
        "type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"], "additionalProperties": False}}},
    {"type": "json_schema", "json_schema": {"name": "pick", "schema": {
        "type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "ok": {"type": "boolean"}}, "required": ["color", "ok"]}}},
    {"type": "json_schema", "json_schema": {"name": "list", "schema": {
        "type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["xs"]}}},
]


def char_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>"] + CHARS)}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(BPE(vocab, [], unk_token=None)), pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return fast


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(seed=5, dtype=torch.float64, vocab_size=VOCAB, num_layers=4, initializer_range=0.3,
                         max_position_embeddings=256)
    target = replace(target, tokenizer=char_tokenizer())
    head = tiny_head(target, 13)
    common = dict(calibration_dir="", cost_aware=False, suffix_drafting=False)
    spec = {"tree": SpeculativeEngine(target, head, EngineConfig(depth=4, topk=3, num_draft_tokens=10,
                                                                 prompt_lookup=False, **common), head_version="v"),
            "tree+lookup": SpeculativeEngine(target, head, EngineConfig(depth=4, topk=3, num_draft_tokens=10,
                                                                        prompt_lookup=True, **common),
                                             head_version="v")}
    plain = SpeculativeEngine(target, None, EngineConfig.plain())
    return target, spec, plain


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    letters = list("abcdefghijklmnopqrstuvwxyz0123456789 ")
    return ["".join(rng.choice(letters, size=int(rng.integers(3, 12)))) for _ in range(n)]


def inside(engine, grammar, tokens) -> bool:
    c = grammar.constraint()
    try:
        c.advance(tokens)
    except GrammarError:
        return False
    return True


@pytest.mark.slow  # about a minute: 128 constrained decodes
def test_constrained_speculative_greedy_equals_constrained_plain_greedy(setup):
    """64 prompt x schema pairs (the two engine configurations in turn): 0 mismatches; every output inside its
    grammar."""
    target, spec, plain = setup
    sp = SamplingParams(max_tokens=32)
    checked = drafted = 0
    for fmt in SCHEMAS:
        for i, p in enumerate(prompts(16, seed=len(json.dumps(fmt)))):
            ref = plain.generate(p, sp, grammar=plain.grammar(fmt))
            assert inside(plain, plain.grammar(fmt), ref.token_ids)
            name = list(spec)[i % 2]
            out = spec[name].generate(p, sp, grammar=spec[name].grammar(fmt))
            assert out.token_ids == ref.token_ids, (name, fmt, p)
            drafted += sum(s.tree_size for s in out.steps)
            checked += 1
    assert checked == 64 and drafted > 0


def test_drafts_outside_the_grammar_are_pruned_and_the_rest_can_be_accepted(setup):
    target, spec, plain = setup
    engine = spec["tree"]
    g = engine.grammar(SCHEMAS[2])  # an enum: after '{"color": "' only r, g or b may follow
    c = g.constraint()
    tokens = target.tokenizer.encode('{"color": "')
    c.advance(tokens)
    from adaptive_eagle.tree import chain_tree

    tok = target.tokenizer.convert_tokens_to_ids
    tree = chain_tree([tok("r"), tok("e"), tok("d"), tok("x")])  # "red" then a refused "x"
    pruned, bits = c.plan(tree)
    assert pruned.tokens.tolist() == [tok("r"), tok("e"), tok("d")] and c.pruned == 1 and bits.shape[0] == 4
    logits = c.mask(torch.zeros(4, VOCAB, dtype=torch.float64), bits)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == sorted([tok("r"), tok("g"), tok("b")])
    assert torch.isfinite(logits[3]).nonzero().flatten().tolist() == [tok('"')]  # after "red": the closing quote
    lengths = [engine.generate(p, SamplingParams(max_tokens=30), grammar=g).trace for p in prompts(8, seed=9)]
    assert any(s.accept_length > 0 for t in lengths for s in t.steps)  # drafts inside the grammar get accepted


@pytest.mark.slow  # about a minute: 1,000 sampled decodes
def test_constrained_sampling_keeps_the_constrained_target_distribution(setup):
    """The first two sampled tokens under a grammar, drawn through speculative verification, against the exact
    constrained distribution (the target's softmax with refused tokens removed and renormalised)."""
    target, spec, plain = setup
    engine, fmt, prompt = spec["tree"], SCHEMAS[0], "ab"
    g = engine.grammar(fmt)
    ids = engine.encode(prompt)

    def constrained_probs(prefix):
        c = g.constraint()
        c.advance(prefix)
        with torch.no_grad():
            logits = target.model(input_ids=torch.tensor([ids + prefix])).logits[0, -1:].float()
        return torch.softmax(c.mask(logits, c.plan(EMPTY_TREE)[1])[0], -1).double()

    # '{' is forced first; then a key's quote or '}', then a key's first character or the end: tokens 2 and 3
    first = constrained_probs([])
    assert first.max() == 1.0
    t1 = int(first.argmax())
    p2 = constrained_probs([t1])
    exact = {}
    for t2 in (p2 > 0).nonzero().flatten().tolist():
        p3 = constrained_probs([t1, t2])
        for t3 in (p3 > 1e-12).nonzero().flatten().tolist():
            exact[(t2, t3)] = float(p2[t2] * p3[t3])
    n = 1000
    counts: dict = {}
    for i in range(n):
        out = engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=3), grammar=g,
                              generator=torch.Generator().manual_seed(i))
        key = tuple(out.token_ids[1:3]) + ((2,) if len(out.token_ids) == 2 else ())  # ended: EOS (id 2)
        assert key in exact, key  # never outside the grammar
        counts[key] = counts.get(key, 0) + 1
    keys = [k for k in exact if exact[k] * n >= 5]
    other = 1.0 - sum(exact[k] for k in keys)
    obs = [counts.get(k, 0) for k in keys] + [n - sum(counts.get(k, 0) for k in keys)]
    exp = [exact[k] * n for k in keys] + [other * n]
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    assert len(keys) >= 3
    assert stats.chisquare(obs, np.array(exp) * sum(obs) / sum(exp)).pvalue > 1e-3, (obs, exp)


@pytest.mark.parametrize("parallel", [False, True])
def test_a_required_tool_call_always_parses_as_a_call_to_a_given_tool(setup, parallel):
    """tool_choice "required" (serving/tools.py's call_format): every answer is hermes tool calls (one, or with
    parallel_tool_calls one to PARALLEL_CALLS) whose arguments match the tool's parameters, speculative output
    equal to plain."""
    from serving.tools import ToolDef, call_format, check_tools, parse

    target, spec, plain = setup
    tools = [ToolDef.model_validate({"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"enum": [1, 2, 30]}, "b": {"type": "boolean"}},
        "required": ["a", "b"], "additionalProperties": False}}}),
        ToolDef.model_validate({"type": "function", "function": {"name": "echo", "parameters": {
            "type": "object", "properties": {"s": {"type": "string", "maxLength": 6}}, "required": ["s"]}}})]
    from serving.tools import PARALLEL_CALLS

    tspec = check_tools(tools, "required", parallel)
    fmt = call_format(tspec)
    engine = spec["tree"]
    sp = SamplingParams(max_tokens=200 if parallel else 80)  # the tiny target holds 256 positions
    counts = []
    for p in prompts(8, seed=21):
        out = engine.generate(p, sp, grammar=engine.grammar(fmt))
        assert out.token_ids == plain.generate(p, sp, grammar=plain.grammar(fmt)).token_ids
        assert out.finish_reason == "stop", out.text
        text = "".join(target.tokenizer.convert_ids_to_tokens(out.token_ids[:-1]))  # the char tokens, EOS cut
        content, calls = parse(text, tspec)
        assert content is None and 1 <= len(calls) <= (PARALLEL_CALLS if parallel else 1), text
        for call in calls:
            args = json.loads(call["function"]["arguments"])
            assert call["function"]["name"] in ("add", "echo")
            assert set(args) == ({"a", "b"} if call["function"]["name"] == "add" else {"s"})
        counts.append(len(calls))
    # one call each without parallel calls; with them these prompts give one answer of two calls (the
    # multi-call grammar exercised, speculative equal to plain)
    assert set(counts) == {1} if not parallel else max(counts) >= 2, counts
    with pytest.raises(GrammarError, match="max_calls"):
        engine.grammar({**fmt, "max_calls": 99})


def test_formats_the_grammar_engine_cannot_serve_are_refused_with_a_reason(setup):
    _, spec, _ = setup
    engine = spec["tree"]
    with pytest.raises(GrammarError, match="expected 'json_object' or 'json_schema'"):
        engine.grammar({"type": "regex"})
    with pytest.raises(GrammarError, match="JSON Schema object"):
        engine.grammar({"type": "json_schema", "json_schema": {"schema": 3}})
    with pytest.raises(GrammarError, match="at most"):
        engine.grammar({"type": "json_schema", "json_schema": {"schema": {"enum": ["x" * 70000]}}})
    assert engine.grammar(SCHEMAS[1]) is engine.grammar(json.loads(json.dumps(SCHEMAS[1])))  # cached
