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
    one may run past max_tokens); `example` is its rendering cut at max_tokens."""

    conversation: Conversation
    example: TokenizedExample
    sources: tuple[str, ...]  # ids of the chained conversations, in order


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
    made = 0
    msgs: list[Message] = []
    sources: list[str] = []
    domains: set[str] = set()
    for conv in convs:
        turns = _turns(conv)
        if not turns:
            continue
        msgs += turns
        sources.append(conv.id)
        domains.add(conv.domain)
        domain = next(iter(domains)) if len(domains) == 1 else classify_domain(msgs)
        chat = Conversation(id="+".join(sources), messages=tuple(msgs), domain=domain)
        example = render(chat, tokenizer, max_tokens)
        if len(example.input_ids) < min_tokens:
            continue
        session_id = f"session-{made}:{sources[0]}+{len(sources) - 1}"
        example = TokenizedExample(session_id, chat.domain, example.input_ids, example.loss_mask)
        yield LongSession(Conversation(session_id, chat.messages, chat.domain), example, tuple(sources))
        made += 1
        if made == n:
            return
        msgs, sources, domains = [], [], set()


__all__ = ["LongSession", "long_sessions"]
