"""Long multi-turn agent sessions, replayed as agents send them.

A session is a list of turns; each turn appends new messages (a user question, or a tool's output
and the question about it) to the conversation, and the served model answers. Every turn's request
carries the whole history, the model's OWN earlier answers included: the replay sends turn k only
after the answer to turn k-1 came back, and appends that answer, not a recorded one. So the served
contexts grow turn by turn to thousands of tokens, as an agent's do.

Two kinds, both from real ShareGPT text of one split:
- chat: the substantive user turns (300 characters or more: questions with pasted code, text, data)
  of consecutive conversations, one user working through several tasks in one session;
- tool: a research agent with a `search` tool. Each turn the user asks a real ShareGPT question, the
  tool's output (role `tool`) is a real ShareGPT answer to it (as a retrieved document, up to
  `tool_chars`), and the model answers from it. Tool outputs make the context grow fast, as agents'
  tool results do.
Sessions alternate chat, tool, chat, ... and are deterministic for a given conversation list and seed.

Owns: building sessions and replaying one through a `generate(messages, turn) -> answer` callable
(an engine, an HTTP client). Must not touch: models, timing, stores.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from trainer.data import Conversation

TOOL_SYSTEM = ("You are a research assistant with a search tool. After each question the tool's results arrive in "
               "a message from the tool. Answer the question from the results, briefly and accurately.")
CHAT_SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True)
class Session:
    id: str
    kind: str  # "chat" | "tool"
    system: str
    turns: tuple[tuple[dict, ...], ...]  # the messages each turn appends before the model answers

    @property
    def index(self) -> int:
        """Build order (ids are "<kind>-<index>"): a build of n sessions holds indexes 0..n-1."""
        return int(self.id.rsplit("-", 1)[1])

    def chars(self) -> int:
        return sum(len(m["content"]) for turn in self.turns for m in turn)


def _latin(text: str) -> bool:
    return sum(c.isascii() for c in text) >= 0.9 * max(1, len(text))


def build_sessions(conversations: Iterable[Conversation], n: int, *, min_chars: int = 16000, max_turns: int = 10,
                   user_chars: int = 3000, tool_chars: int = 3000, answer_chars: int = 400,
                   seed: int = 0) -> list[Session]:
    """`n` sessions alternating chat and tool kinds, each of about `min_chars` characters of context (about
    a quarter as many tokens): the user and tool text plus `answer_chars` a turn for the model's answer,
    or `max_turns` turns."""
    chat_turns: list[str] = []
    tool_turns: list[tuple[str, str]] = []
    for i, conv in enumerate(conversations):  # each conversation feeds one kind: even ones chat first, odd tool
        users = [m.content.strip() for m in conv.messages if m.role == "user"]
        users = [u for u in users if 300 <= len(u) <= user_chars and _latin(u)]  # substantive turns
        pairs = list(zip(conv.messages, conv.messages[1:]))
        q, a = next(((u.content.strip(), v.content.strip()) for u, v in pairs
                     if u.role == "user" and v.role == "assistant"), ("", ""))
        chat_ok, tool_ok = bool(users), 20 <= len(q) <= 300 and len(a) >= 400 and _latin(q + a)
        if chat_ok and (i % 2 == 0 or not tool_ok):
            chat_turns.extend(users)
        elif tool_ok:
            tool_turns.append((q, a[:tool_chars]))
    rng = random.Random(seed)
    sessions: list[Session] = []
    ci = ti = 0
    while len(sessions) < n:
        kind = "chat" if len(sessions) % 2 == 0 else "tool"
        turns: list[tuple[dict, ...]] = []
        size = 0
        while size < min_chars and len(turns) < max_turns:
            if kind == "chat":
                if ci >= len(chat_turns):
                    break
                turns.append(({"role": "user", "content": chat_turns[ci]},))
                ci += 1
            else:
                if ti >= len(tool_turns):
                    break
                q, doc = tool_turns[ti]
                ti += 1
                turns.append(({"role": "user", "content": q},
                              {"role": "tool", "content": f'search("{q[:80]}") returned:\n{doc}'}))
            size += sum(len(m["content"]) for m in turns[-1]) + answer_chars
        if size < min_chars and len(turns) < max_turns:
            break  # the split ran out of text for this kind
        sessions.append(Session(f"{kind}-{len(sessions)}", kind, CHAT_SYSTEM if kind == "chat" else TOOL_SYSTEM,
                                tuple(turns)))
    if len(sessions) < n:
        raise ValueError(f"the conversations hold text for {len(sessions)} sessions of {min_chars} characters, not {n}")
    rng.shuffle(sessions)
    return sessions


def replay(session: Session, generate: Callable[[list[dict], int], str | None], *,
           fits: Callable[[list[dict]], bool] = lambda messages: True) -> list[list[dict]]:
    """Send the session turn by turn: turn k's request is the system message, every earlier turn's messages
    and the model's own answers to them, then turn k's messages. `generate(messages, k)` returns the
    model's answer (None ends the session); a turn whose request `fits` refuses (past the context) ends it.
    Returns the requests sent."""
    history: list[dict] = [{"role": "system", "content": session.system}]
    sent: list[list[dict]] = []
    for k, turn in enumerate(session.turns):
        request = history + list(turn)
        if not fits(request):
            break
        answer = generate(request, k)
        sent.append(request)
        if answer is None:
            break
        history = request + [{"role": "assistant", "content": answer}]
    return sent


def split_sessions(sessions: Sequence[Session]) -> dict[str, int]:
    return {"chat": sum(s.kind == "chat" for s in sessions), "tool": sum(s.kind == "tool" for s in sessions)}


__all__ = ["CHAT_SYSTEM", "TOOL_SYSTEM", "Session", "build_sessions", "replay", "split_sessions"]
