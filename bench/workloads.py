"""Request workloads for decode benchmarks, built from real ShareGPT inputs.

`agent_prompts`: "agent" traffic, where a fixed output format meets varying real inputs, as tool
routers, text-to-SQL and report bots produce it. Three kinds are interleaved (tool, sql, summary,
tool, ...):

- tool: the system prompt fixes one JSON tool-call schema ({"tool": "search", "arguments":
  {"query", "language", "max_results"}}); the user message is a real ShareGPT question; the
  assistant answers with the JSON only;
- sql: a fixed CREATE TABLE in the system prompt; the user asks for a query counting one user's
  messages that mention a word taken from a real ShareGPT question;
- summary: a fixed three-line template ("Summary:\\n- Topic: ...\\n- Key points: ...\\n- Next
  step: ...") over a real ShareGPT text snippet.

Each request carries two worked examples (user turns and the assistant's answers) so that a small
target (SmolLM2-135M-Instruct) follows the format; with one, it tends to repeat the example
verbatim. Served in sequence, later outputs repeat the schema and template tokens of earlier ones,
which a cross-request suffix index (`adaptive_eagle.suffix_index`) drafts from. The examples put
the template in every prompt as well, so prompt lookup drafts much of it too: the index adds what
outputs share beyond the examples (the model's own phrasing of the varying parts and its
departures from the examples). Deterministic for a given seed and conversation list.

Owns: prompt construction only. Must not touch: models, engines, timing.
"""

from __future__ import annotations

import random
import re
from typing import Iterable

from trainer.data import Conversation

AGENT_KINDS = ("tool", "sql", "summary")


def _tool_call(question: str) -> str:
    return ('{"tool": "search", "arguments": {"query": "%s", "language": "en", "max_results": 5}}'
            % question.replace('"', "'"))


TOOL_SYSTEM = (
    "You turn the user's question into a search tool call. Reply with one JSON object and nothing else, "
    'in exactly this form:\n{"tool": "search", "arguments": {"query": "<the question>", "language": "en", '
    '"max_results": 5}}'
)
TOOL_EXAMPLES = tuple(
    (f"Question: {q}", _tool_call(q))
    for q in ("How do I keep my sourdough starter alive while I am on holiday?",
              "Which laptops have the longest battery life?")
)

SQL_TABLE = "CREATE TABLE messages (id INTEGER PRIMARY KEY, user_name TEXT, content TEXT, created_at TEXT);"
SQL_SYSTEM = f"You write SQLite queries for this table:\n{SQL_TABLE}\nReply with one SQL query and nothing else."
SQL_EXAMPLES = tuple(
    (f"Count the messages from user '{u}' that mention '{w}'.",
     f"SELECT COUNT(*) FROM messages WHERE user_name = '{u}' AND content LIKE '%{w}%';")
    for u, w in (("zoe", "garden"), ("yuki", "python"))
)
SQL_USERS = ("alice", "bob", "carol", "dave", "erin", "frank")

SUMMARY_SYSTEM = (
    "Summarise the text in exactly this format and nothing else:\nSummary:\n- Topic: <a few words>\n"
    "- Key points: <one sentence>\n- Next step: <one sentence>"
)
SUMMARY_EXAMPLES = (
    ("Text: Our team moved the weekly meeting to Thursday because too many people were travelling on "
     "Mondays. We also agreed to share the agenda a day in advance.",
     "Summary:\n- Topic: Weekly meeting schedule\n- Key points: The meeting moves to Thursday and the agenda "
     "is shared a day ahead.\n- Next step: Send the agenda on Wednesday."),
    ("Text: The new checkout page loads in two seconds instead of five, but some users on older phones "
     "report that the pay button does not respond.",
     "Summary:\n- Topic: Checkout page performance\n- Key points: The page is faster, but the pay button "
     "fails on some older phones.\n- Next step: Test the pay button on older phones."),
)

_STOP = frozenset(
    "about above after again against because before being below between could doing during every "
    "further having other should their there these those through under until where which while would "
    "write please thanks thank hello really something anything everything someone anyone different "
    "possible example following using make give tell explain".split()
)


def _latin(text: str) -> bool:
    return all(ord(ch) < 0x250 or ch in "\u2018\u2019\u201c\u201d\u2013\u2014" for ch in text)


def _question(conv: Conversation, max_chars: int = 300) -> str | None:
    """The conversation's first user message when it is a short one-paragraph question."""
    first = next((m.content for m in conv.messages if m.role == "user"), "")
    text = " ".join(first.split())
    if not 20 <= len(text) <= max_chars or "```" in first or not _latin(text):
        return None
    return text


def _snippet(conv: Conversation, min_chars: int = 200, max_chars: int = 480) -> str | None:
    """A prose snippet (first reply or user message of at least min_chars), cut at a word boundary."""
    for m in conv.messages:
        text = " ".join(m.content.split())
        if len(text) >= min_chars and "```" not in m.content and _latin(text):
            return text[:max_chars].rsplit(" ", 1)[0] if len(text) > max_chars else text
    return None


def _keyword(question: str) -> str:
    """A content word of the question (the longest, ties to the first), for the SQL filter."""
    words = [w.lower() for w in re.findall(r"[A-Za-z]{5,}", question) if w.lower() not in _STOP]
    return max(words, key=len) if words else "help"


def _chat(system: str, examples: tuple[tuple[str, str], ...], user: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}]
    for question, answer in examples:
        msgs += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return msgs + [{"role": "user", "content": user}]


def agent_prompts(conversations: Iterable[Conversation], n: int, seed: int = 0) -> list[list[dict]]:
    """`n` chat requests (lists of {role, content}), the kinds interleaved tool, sql, summary, ...;
    inputs drawn without replacement from `conversations` (e.g. `select(load_sharegpt(),
    domains=["english"], split="heldout")`). Raises ValueError when too few conversations fit."""
    convs = list(conversations)
    rng = random.Random(seed)
    questions = [q for q in map(_question, convs) if q]
    snippets = [s for s in map(_snippet, convs) if s]
    rng.shuffle(questions)
    rng.shuffle(snippets)
    kinds = [AGENT_KINDS[i % len(AGENT_KINDS)] for i in range(n)]
    need_q, need_s = sum(k != "summary" for k in kinds), kinds.count("summary")
    if len(questions) < need_q or len(snippets) < need_s:
        raise ValueError(f"{n} agent prompts need {need_q} short questions and {need_s} snippets; "
                         f"the conversations give {len(questions)} and {len(snippets)}")
    out = []
    for kind in kinds:
        if kind == "tool":
            out.append(_chat(TOOL_SYSTEM, TOOL_EXAMPLES, f"Question: {questions.pop()}"))
        elif kind == "sql":
            word, user = _keyword(questions.pop()), rng.choice(SQL_USERS)
            out.append(_chat(SQL_SYSTEM, SQL_EXAMPLES, f"Count the messages from user '{user}' that mention '{word}'."))
        else:
            out.append(_chat(SUMMARY_SYSTEM, SUMMARY_EXAMPLES, f"Text: {snippets.pop()}"))
    return out

JSON_FORMATS = (
    {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
        "type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"},
                                         "topics": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["answer", "confidence", "topics"], "additionalProperties": False}}},
    {"type": "json_schema", "json_schema": {"name": "triage", "strict": True, "schema": {
        "type": "object", "properties": {"category": {"enum": ["question", "request", "complaint", "other"]},
                                         "urgent": {"type": "boolean"}, "summary": {"type": "string"}},
        "required": ["category", "urgent", "summary"], "additionalProperties": False}}},
    {"type": "json_object"},
)
JSON_INSTRUCTIONS = ("Answer the question as JSON with the fields answer, confidence (0 to 1) and topics.",
                     "Triage this message as JSON with the fields category, urgent and summary.",
                     "Reply with a JSON object describing the question: its subject, its kind and a short answer.")


def json_prompts(conversations: Iterable[Conversation], n: int, seed: int = 0) -> list[tuple[list[dict], dict]]:
    """`n` (chat request, response_format) pairs: held-out questions under three formats in turn (two strict
    JSON schemas, and JSON mode), the structured-output traffic agents send."""
    rng = random.Random(seed)
    questions = [q for q in map(_question, conversations) if q]
    rng.shuffle(questions)
    if len(questions) < n:
        raise ValueError(f"{n} json prompts need {n} short questions; the conversations give {len(questions)}")
    out = []
    for i in range(n):
        k = i % len(JSON_FORMATS)
        out.append(([{"role": "system", "content": JSON_INSTRUCTIONS[k]}, {"role": "user", "content": questions[i]}],
                    JSON_FORMATS[k]))
    return out
