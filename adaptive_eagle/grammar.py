"""Constrained decoding, lossless under speculation: a grammar (any JSON value, a JSON schema) masks the target's
logits at every position the engine decodes, every node of a draft tree included, each along its own path.

Why it stays exact. The constrained target is the target's distribution with the tokens the grammar refuses
removed and the rest renormalised (greedy: the argmax over the allowed tokens), which is what plain constrained
decoding samples from. Verification only ever reads the target's rows: row r is masked with the grammar's state
after the path to r (the matcher advanced along the path, then rolled back), so each row is exactly the
constrained target's distribution there, and the verify rules (verify.py) keep any target distribution
exactly. A draft the grammar refuses has probability 0 in its parent's row and can never be accepted: it is
pruned before the verify forward, which only saves work.

Backed by xgrammar (SGLang's default grammar engine; CPU wheels): `Grammars` compiles per tokenizer (its
compiler caches), `Constraint` is one request's matcher. Must not touch: models, caches, verification rules.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from typing import Any, Optional

import torch

from adaptive_eagle.tree import DraftTree, subset_tree

MAX_SCHEMA_BYTES = 64 << 10
MAX_CALLS = 8  # the most tool calls one constrained answer may hold (a parallel required call)


class GrammarError(ValueError):
    """A grammar that cannot be served: bad spec or schema (the message says which and why)."""


def spec_key(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def tool_call_grammar(spec: dict):
    """The language of a {"type": "tool_call", "json_schema": {"schema": ...}, "max_calls": n} spec, tokenizer-free
    (an xgrammar Grammar): one to n calls in the hermes format, one a line,
    <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>, each call's JSON matching the schema in one
    whitespace layout. The reference engine compiles this grammar; SGLang replicas get its EBNF text
    (`tool_call_ebnf`), which names the same language, for SGLang's own grammar backend."""
    import xgrammar as xgr

    schema = (spec.get("json_schema") or {}).get("schema")
    if not isinstance(schema, dict):
        raise GrammarError("tool_call: json_schema.schema must be a JSON Schema object")
    most = spec.get("max_calls", 1)
    if not isinstance(most, int) or isinstance(most, bool) or not 1 <= most <= MAX_CALLS:
        raise GrammarError(f"tool_call: max_calls must be an integer in [1, {MAX_CALLS}], got {most!r}")
    call = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    one = xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), call,
                             xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))
    line, nothing = xgr.Grammar.from_ebnf('root ::= "\\n"'), xgr.Grammar.from_ebnf('root ::= ""')
    more = None  # after a call: nothing, or a line and another call (and what may follow that), n-1 deep
    for _ in range(most - 1):
        more = xgr.Grammar.union(nothing, xgr.Grammar.concat(*([line, one] + ([more] if more is not None else []))))
    return one if more is None else xgr.Grammar.concat(one, more)


@contextmanager
def engine_refusals():
    """The grammar engine refuses a schema with its own exception types: re-raised as GrammarError."""
    try:
        yield
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever xgrammar raises for a schema it cannot compile
        raise GrammarError(f"the grammar engine cannot compile this schema: {type(e).__name__}: {e}") from None


def tool_call_ebnf(spec: dict) -> str:
    """`tool_call_grammar` as EBNF text (what SGLang's SamplingParams.ebnf takes). Raises GrammarError when the
    schema cannot be compiled."""
    with engine_refusals():
        return str(tool_call_grammar(spec))


class Grammars:
    """Compiles response formats for one tokenizer (vocab_size: the target's logits width, which may exceed the
    tokenizer's). Thread-safe; compiled grammars are cached by their spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Optional[list[int]] = None) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._cache: dict[str, Any] = {}

    def compile(self, spec: dict) -> "Grammar":
        """spec: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": {...}, "strict"}}
        (the OpenAI response_format), or {"type": "tool_call", "json_schema": {"schema": {...}}, "max_calls": n}:
        one to n tool calls (default 1) in the hermes format, one a line, each JSON matching the schema
        (serving/tools.py builds it from the tools)."""
        key = spec_key(spec)
        if len(key) > MAX_SCHEMA_BYTES:
            raise GrammarError(f"the response format is {len(key)} bytes of JSON; at most {MAX_SCHEMA_BYTES}")
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        kind = spec.get("type")
        with engine_refusals():
            if kind == "tool_call":
                return self._keep(key, self.compiler.compile_grammar(tool_call_grammar(spec)))
            if kind == "json_object":  # OpenAI's JSON mode: any JSON object
                schema, strict = {"type": "object"}, False
            elif kind == "json_schema":
                body = spec.get("json_schema") or {}
                schema = body.get("schema", {}) if isinstance(body, dict) else None
                strict = bool(body.get("strict")) if isinstance(body, dict) else False
                if not isinstance(schema, dict):
                    raise GrammarError("json_schema.schema must be a JSON Schema object")
            else:
                raise GrammarError(f"type {kind!r}: expected 'json_object' or 'json_schema'")
            # one whitespace layout (no free runs of spaces and newlines): what a parser reads is unchanged, and a
            # model cannot spend its tokens on blank space
            compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                         strict_mode=strict)
        return self._keep(key, compiled)

    def _keep(self, key: str, compiled) -> "Grammar":
        grammar = Grammar(compiled, self)
        first = grammar.constraint()
        if not first.allowed_first():
            raise GrammarError("no token of this tokenizer can start this format: the model cannot write it")
        with self._lock:
            self._cache[key] = grammar
        return grammar


class Grammar:
    """A compiled grammar; `constraint()` starts one request's matcher on it."""

    def __init__(self, compiled, owner: Grammars) -> None:
        self.compiled, self.owner = compiled, owner

    def constraint(self) -> "Constraint":
        return Constraint(self)


class Constraint:
    """One request's grammar state. `plan(tree)` prunes a draft tree to the paths the grammar allows and gives
    the token mask of every verify row of the pruned tree (row 0: the root, the state after the committed
    tokens); `mask(logits, bits)` applies it; `advance(tokens)` commits a step's tokens."""

    def __init__(self, grammar: Grammar) -> None:
        xgr = grammar.owner.xgr
        self.xgr, self.vocab_size = xgr, grammar.owner.vocab_size
        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self._bits = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.mask_s = 0.0  # seconds spent walking trees and filling masks (the constraint's cost)
        self.pruned = 0  # draft nodes the grammar refused before verification

    def allowed_first(self) -> bool:
        """Some token may come next (checked once per compiled grammar: a tokenizer that cannot spell it)."""
        bits = self._bits[:1]
        self.matcher.fill_next_token_bitmask(bits, 0)
        return bool((bits != 0).any())

    @property
    def done(self) -> bool:
        """The grammar accepted a stop token: nothing more may follow."""
        return self.matcher.is_terminated()

    def plan(self, tree: DraftTree) -> tuple[DraftTree, torch.Tensor]:
        """(the tree pruned to allowed paths, the bitmask of its verify rows [size + 1, words])."""
        t0 = time.perf_counter()
        n = tree.size
        if self._bits.shape[0] < n + 1:
            self._bits = self.xgr.allocate_token_bitmask(n + 1, self.vocab_size)
        bits = self._bits[: n + 1]
        bits.fill_(-1)  # all allowed: rows of refused nodes are never read
        tokens, kids = tree.tokens.tolist(), [[] for _ in range(n + 1)]
        for i, p in enumerate(tree.parents.tolist()):
            kids[p + 1].append(i)
        valid: list[int] = []
        m = self.matcher

        def walk(row: int) -> None:
            if not m.is_terminated():
                m.fill_next_token_bitmask(bits, row)
            for c in kids[row]:
                if not m.is_terminated() and m.accept_token(tokens[c]):
                    valid.append(c)
                    walk(c + 1)
                    m.rollback(1)

        walk(0)
        keep = sorted(valid)
        self.pruned += n - len(keep)
        if len(keep) < n:
            rows = torch.tensor([0] + [i + 1 for i in keep], dtype=torch.long)
            tree, bits = subset_tree(tree, keep), bits.index_select(0, rows)
        self.mask_s += time.perf_counter() - t0
        if not bool((bits[0] != 0).any()) and not m.is_terminated():
            raise GrammarError("the grammar allows no next token here (the format cannot be completed)")
        return tree, bits.clone()

    def mask(self, logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        """logits [rows, V] with the refused tokens of each row at -inf (a float32 copy where needed)."""
        t0 = time.perf_counter()
        out = logits.float().contiguous() if logits.dtype != torch.float32 or not logits.is_contiguous() else logits
        if out.device.type != "cpu":
            bits = bits.to(out.device)
        self.xgr.apply_token_bitmask_inplace(out, bits, vocab_size=self.vocab_size)
        self.mask_s += time.perf_counter() - t0
        return out

    def advance(self, tokens) -> None:
        """Commit a step's tokens (those after a stop token are past the output's end and ignored)."""
        for t in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(int(t)):
                raise GrammarError(f"the grammar refused committed token {int(t)}: masking failed")


__all__ = ["Constraint", "Grammar", "GrammarError", "Grammars", "MAX_SCHEMA_BYTES", "spec_key"]
