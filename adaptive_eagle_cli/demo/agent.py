"""The agent scenario's tools and tasks: a real agent loop, as an agent framework drives the endpoint.

An agent task is two requests through the OpenAI endpoint: the user's task with the tool set and
tool_choice "required" (the answer must be one call, constrained by the call's grammar), then, after the
client ran the tool, the history with the assistant's call and the tool's result and tool_choice "auto"
(the model answers, or calls again; the task ends there either way). The drift is a new tool set: the
domain `tools` offers TOOLS_V1, `tools2` offers TOOLS_V2 (other names, other argument schemas), so the
rendered schemas in every prompt and the calls the model writes change at once.

The tools are small and deterministic (same arguments, same result):
- search: the held-out ShareGPT passage sharing most words with the query (held-out text reaches the
  model only as tool results here, never as a prompt of its own; offline evaluations score heads on the
  held-out split's answers, which the demo never sends);
- a calculator over + - * / ** and parentheses (Python's ast, numbers only: never eval);
- a key-value memory, one per client.

Owns: the tool sets, running a call, checking a call against its tool, the tasks, the agent's place in a
task. Must not touch: the stack, the clients' transport (traffic.py), the report.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import jsonschema

TOOL_DOMAINS = ("tools", "tools2")  # the tool set of each agent domain: TOOLS_V1, TOOLS_V2
CALL_TOKENS = 128  # tokens a "required" turn may use: a call's JSON closes well within this (strings are capped)
MAX_RESULT_CHARS = 360  # a tool result as the model sees it


def _fn(name: str, description: str, properties: dict, required: Sequence[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(required), "additionalProperties": False}}}


def _text(description: str, max_length: int = 64) -> dict:
    return {"type": "string", "description": description, "minLength": 1, "maxLength": max_length}


TOOLS_V1 = (
    _fn("search", "Search the document collection; returns the passage that best matches the query.",
        {"query": _text("words to look for")}, ["query"]),
    _fn("calculator", "Evaluate an arithmetic expression with + - * / ** and parentheses.",
        {"expression": _text("the expression, e.g. (3 + 4) * 12", 48)}, ["expression"]),
    _fn("memory_set", "Store a value under a key in the user's memory.",
        {"key": _text("the key", 32), "value": _text("the value", 48)}, ["key", "value"]),
    _fn("memory_get", "Read the value stored under a key in the user's memory.",
        {"key": _text("the key", 32)}, ["key"]),
)
TOOLS_V2 = (
    _fn("find_passages", "Look up passages in the knowledge base.",
        {"terms": _text("search terms"), "top_k": {"type": "integer", "minimum": 1, "maximum": 3},
         "language": {"type": "string", "enum": ["en", "any"]}}, ["terms", "top_k", "language"]),
    _fn("evaluate", "Compute a numeric expression and round the result.",
        {"formula": _text("the formula, e.g. 2 ** 10 - 1", 48), "decimals": {"type": "integer", "minimum": 0,
                                                                             "maximum": 6}},
        ["formula", "decimals"]),
    _fn("notes", "Read, write or delete a named note.",
        {"action": {"type": "string", "enum": ["read", "write", "delete"]}, "name": _text("the note's name", 32),
         "text": _text("the note's text (write only)", 48)}, ["action", "name"]),
)
TOOL_SETS = {"tools": TOOLS_V1, "tools2": TOOLS_V2}
SYSTEM = "You are a helpful assistant with tools. Use a tool when it helps, then answer the user briefly."


# ---- running a call -------------------------------------------------------------------------------------
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> float:
    """An arithmetic expression's value: numbers, + - * / ** and parentheses only (ValueError otherwise)."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r}") from e
    return value(tree.body)


_WORD = re.compile(r"[a-z0-9]{3,}")


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


@dataclass
class Toolbox:
    """The tools of one client: the passages search looks in (shared, read-only) and its own memory."""

    passages: Sequence[str]
    memory: dict[str, str] = field(default_factory=dict)

    def search(self, query: str) -> str:
        want = _words(query)
        best = max(range(len(self.passages)), key=lambda i: (len(want & _words(self.passages[i])), -i), default=None)
        if best is None or not want & _words(self.passages[best]):
            return "no passage matches"
        return self.passages[best][:MAX_RESULT_CHARS]

    def run(self, name: str, arguments: str) -> str:
        """The tool's result as the model will read it; a call it cannot run gets an error text (as a real tool
        would answer), never an exception."""
        try:
            args = json.loads(arguments)
        except ValueError:
            return "error: the arguments are not JSON"
        if not isinstance(args, dict):
            return "error: the arguments must be an object"
        try:
            return self._run(name, args)[:MAX_RESULT_CHARS]
        except (ValueError, TypeError, ZeroDivisionError, OverflowError, KeyError) as e:
            return f"error: {type(e).__name__}: {e}"[:MAX_RESULT_CHARS]

    def _run(self, name: str, a: dict) -> str:
        if name == "search":
            return self.search(str(a["query"]))
        if name == "find_passages":
            return self.search(str(a["terms"]))
        if name == "calculator":
            return f"{calculate(str(a['expression'])):g}"
        if name == "evaluate":
            return f"{round(calculate(str(a['formula'])), int(a.get('decimals', 2))):g}"
        if name == "memory_set" or (name == "notes" and a.get("action") == "write"):
            key = str(a.get("key", a.get("name")))
            self.memory[key] = str(a.get("value", a.get("text", "")))
            return f"stored {key}"
        if name == "memory_get" or (name == "notes" and a.get("action") == "read"):
            key = str(a.get("key", a.get("name")))
            return self.memory.get(key, f"nothing stored under {key}")
        if name == "notes" and a.get("action") == "delete":
            return f"deleted {a['name']}" if self.memory.pop(str(a["name"]), None) is not None else "no such note"
        return f"error: no tool named {name}"


def call_valid(domain: str, name: str, arguments: str) -> bool:
    """The call names a tool of the domain's set and its arguments are JSON matching that tool's parameters."""
    tool = next((t["function"] for t in TOOL_SETS[domain] if t["function"]["name"] == name), None)
    if tool is None:
        return False
    try:
        jsonschema.validate(json.loads(arguments), tool["parameters"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# ---- tasks ------------------------------------------------------------------------------------------------
THINGS = ("favourite colour", "dentist's phone number", "flight number", "locker code", "cat's name", "wifi password")
VALUES = ("teal", "555-0142", "LX 318", "4471", "Miso", "orange-harbour-7")


def tasks(questions: Sequence[str], n: int, seed: int) -> list[str]:
    """`n` user tasks, three kinds interleaved: a real question to look up (ShareGPT), arithmetic, memory."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(n):
        kind = i % 3
        if kind == 0 and questions:
            out.append(f"Look this up in the documents, then answer: {questions[(i // 3) % len(questions)]}")
        elif kind == 1:
            a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(1, 50)
            form = rng.choice(("What is {a} * {b} + {c}?", "Compute ({a} + {b}) / {c}.", "What is {a} - {b} * {c}?",
                               "How much is {b} ** 2 + {a}?"))
            out.append(form.format(a=a, b=b, c=c))
        else:
            k = rng.randrange(len(THINGS))
            out.append(rng.choice((f"Please remember that my {THINGS[k]} is {VALUES[k]}.",
                                   f"What did I tell you my {THINGS[k]} is?")))
    return out


@dataclass(frozen=True)
class AgentTurn:
    """One request of an agent task: the messages so far (dicts as the openai client takes them, assistant
    tool_calls and tool results included), the tool set and the tool_choice."""

    messages: tuple
    tools: tuple
    tool_choice: str
    max_tokens: int


def first_turn(task: str, domain: str, max_tokens: int) -> AgentTurn:
    return AgentTurn(({"role": "system", "content": SYSTEM}, {"role": "user", "content": task}), TOOL_SETS[domain],
                     "required", max(max_tokens, CALL_TOKENS))


def second_turn(messages: tuple, tools: tuple, calls: Sequence[tuple[str, str, str]], toolbox: Toolbox,
                max_tokens: int) -> AgentTurn:
    """The history `messages` after the model's calls ((id, name, arguments) each): the assistant message with the
    calls and one tool message per call with what the tool returned; the same tools, tool_choice "auto"."""
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": args}} for cid, name, args in calls]}
    results = tuple({"role": "tool", "tool_call_id": cid, "content": toolbox.run(name, args)}
                    for cid, name, args in calls)
    return AgentTurn(messages + (assistant,) + results, tools, "auto", max_tokens)


def canonical(content: Optional[str], calls: Sequence[tuple[str, str]]) -> str:
    """An answer as one text: the content and each call (name, arguments as parsed JSON re-dumped): two answers
    are the same for a user exactly when these are equal (call ids are random per response)."""
    parts = [content or ""]
    for name, args in calls:
        try:
            parsed: Any = json.loads(args)
        except ValueError:
            parsed = args
        parts.append(json.dumps({"name": name, "arguments": parsed}, sort_keys=True, ensure_ascii=False))
    return "\n".join(parts)


__all__ = ["AgentTurn", "CALL_TOKENS", "SYSTEM", "TOOLS_V1", "TOOLS_V2", "TOOL_DOMAINS", "TOOL_SETS", "Toolbox",
           "calculate", "call_valid", "canonical", "first_turn", "second_turn", "tasks"]
