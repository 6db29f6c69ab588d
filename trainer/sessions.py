"""Long sessions: consecutive conversations chained into one chat that reaches a target length.

Owns: building long-context material from short conversations. Held-out ShareGPT has hardly any
conversation over 4k tokens (none of 4-8k with the SmolLM2 tokenizer), so a long session is built
the way a long chat happens: one user working through several tasks in one session, every turn
carrying the whole history. Conversations of the chosen split (and domains) are taken in file
order, each trimmed to end on an assistant turn, their system messages dropped (the template's
own system prompt opens the session), and appended until the rendered chat reaches `min_tokens`;
the rendering is cut at `max_tokens` (trainer.data.render: loss mask on assistant turns only).
Consecutive sessions use disjoint runs of conversations; the order is deterministic. Must not
touch models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from trainer.data import Conversation, DataError, Message, TokenizedExample, classify_domain, render, select


@dataclass(frozen=True)
class LongSession:
    """One chained chat. `conversation` holds every message of the chained conversations (the last
    one may run past max_tokens); `example` is its rendering cut at max_tokens. Its domain is the
    chained conversations' common domain (classify_domain of the whole chat when they differ)."""

    conversation: Conversation
    example: TokenizedExample
    parts: tuple[Conversation, ...]  # the chained conversations as they appear in it (system messages dropped)
    starts: tuple[int, ...]  # token index in `example` where each part's first message begins

    @property
    def sources(self) -> tuple[str, ...]:
        """Ids of the chained conversations, in order."""
        return tuple(p.id for p in self.parts)


def _turns(conv: Conversation) -> tuple[Message, ...]:
    """The conversation's user and assistant messages, up to its last assistant turn."""
    msgs = [m for m in conv.messages if m.role != "system"]
    while msgs and msgs[-1].role != "assistant":
        msgs.pop()
    return tuple(msgs)


def long_sessions(conversations: Iterable[Conversation], tokenizer, *, min_tokens: int, max_tokens: int, n: int,
                  split: str | None = "heldout", domains: Iterable[str] | None = None) -> list[LongSession]:
    """Up to `n` sessions whose renderings have min_tokens <= len <= max_tokens tokens, built from
    consecutive conversations of `split` ("heldout", "train" or None for both) and `domains`
    (None: all). Fewer than `n` come back when the conversations run out; a tail that never reaches
    min_tokens is dropped."""
    if not 1 <= min_tokens <= max_tokens:
        raise DataError(f"min_tokens {min_tokens} and max_tokens {max_tokens}: need 1 <= min_tokens <= max_tokens")
    if n < 1:
        raise DataError(f"n {n}: need at least 1 session")
    return list(_sessions(select(conversations, domains=domains, split=split), tokenizer, min_tokens, max_tokens, n))


def _sessions(convs: Iterator[Conversation], tokenizer, min_tokens: int, max_tokens: int, n: int):
    made, rendered = 0, 0  # rendered: tokens of the chain so far (whole: it stayed under min_tokens)
    parts: list[Conversation] = []
    starts: list[int] = []
    for conv in convs:
        turns = _turns(conv)
        if not turns:
            continue
        parts.append(Conversation(conv.id, turns, conv.domain))
        starts.append(rendered)
        msgs = tuple(m for p in parts for m in p.messages)
        domains = {p.domain for p in parts}
        domain = next(iter(domains)) if len(domains) == 1 else classify_domain(msgs)
        example = render(Conversation("+".join(p.id for p in parts), msgs, domain), tokenizer, max_tokens)
        rendered = len(example.input_ids)
        if rendered < min_tokens:
            continue
        session_id = f"session-{made}:{parts[0].id}+{len(parts) - 1}"
        example = TokenizedExample(session_id, domain, example.input_ids, example.loss_mask)
        yield LongSession(Conversation(session_id, msgs, domain), example, tuple(parts), tuple(starts))
        made += 1
        if made == n:
            return
        parts, starts, rendered = [], [], 0


__all__ = ["LongSession", "long_sessions"]
