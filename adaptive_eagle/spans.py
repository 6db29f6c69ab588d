"""What each stretch of a captured request's tokens is: the spans of a TraceRecord (trace.SPAN_KINDS).

A chat prompt's spans are its messages, found by templating the first k messages for each k and checking
that each is a prefix of the whole prompt (true of ChatML-style templates; where a template rewrites earlier
turns, the prompt gets no spans rather than wrong ones). A message's span includes the template's framing of
it. The answer's span is "constrained" when a grammar decoded it, else "model". So a record says which tokens
are rendered tool schemas, tool results, the user's text, earlier model answers, and this answer, and whether
a grammar shaped it.

Owns: computing spans. Must not touch: decoding, capture policy, storage.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from adaptive_eagle.trace import SPAN_KINDS

log = logging.getLogger(__name__)


def _template_ids(tokenizer, messages: Sequence[dict], tools: Optional[list]) -> list[int]:
    kw = {"tools": tools} if tools is not None else {}
    out = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=False, tokenize=True, **kw)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(t) for t in ids]


def message_spans(tokenizer, messages: Sequence[dict], kinds: Optional[Sequence[str]],
                  prompt_ids: Sequence[int], tools: Optional[list] = None) -> tuple[tuple[int, int, str], ...]:
    """(start, end, kind) of each message of a chat prompt templated into `prompt_ids` (with `tools` passed to
    the template, when it renders them); kinds: what each message is (None: its role; a role outside SPAN_KINDS
    leaves its message unmarked). () when the template is not
    prefix-consistent for these messages or refuses one of their prefixes (spans are a record's metadata: they
    never fail a request)."""
    kinds = list(kinds) if kinds is not None else [str(m.get("role")) for m in messages]
    prompt = list(prompt_ids)
    spans, start = [], 0
    for k in range(1, len(messages) + 1):
        try:
            ids = _template_ids(tokenizer, messages[:k], tools)
        except Exception:  # noqa: BLE001 - a template may refuse a partial conversation: no spans, never a failure
            log.debug("no spans: the chat template refused the first %d messages", k, exc_info=True)
            return ()
        if ids[:start] != prompt[:start] or ids != prompt[:len(ids)] or len(ids) <= start:
            return ()
        if kinds[k - 1] in SPAN_KINDS:
            spans.append((start, len(ids), kinds[k - 1]))
        start = len(ids)
    return tuple(spans)


def answer_span(n_prompt: int, n_total: int, constrained: bool) -> tuple[tuple[int, int, str], ...]:
    """The generated tokens' span (none when nothing was generated)."""
    return ((n_prompt, n_total, "constrained" if constrained else "model"),) if n_total > n_prompt else ()


__all__ = ["answer_span", "message_spans"]
