"""Tool calling on the chat endpoint, as the OpenAI API specifies it: `tools` (function tools with JSON-schema
parameters), `tool_choice`, `parallel_tool_calls`, assistant messages carrying `tool_calls`, `tool` messages
answering them, and `message.tool_calls` / streamed tool-call deltas in the response.

Owns: checking a request's tools and tool history (a 400 naming the field), carrying them to a replica
(`wire_messages`, `wire_tools`), rendering them for the target's chat template there (`chat_prompt`,
`template_ids`), and parsing the model's text back into tool calls, whole or as a stream. Must not touch: HTTP,
routing, engines (replicas call `chat_prompt` with their target's tokenizer; the engine sees token ids).

Format: "hermes", the one vLLM's and SGLang's `hermes` tool-call parsers read, used by Qwen2.5 and Hermes models.
A target whose own chat template renders tools in this format (`speaks_hermes`, probed once per template) gets
them rendered by that template: apply_chat_template(messages, tools=...), calls and tool results in the Hugging
Face message form. Any other template (SmolLM2's ChatML has no tool support of its own) gets this documented
rendering into plain role/content messages:
- the tools go into the system message, one JSON object a line inside <tools></tools>, with the instruction
  to answer a call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>;
- an assistant turn's tool calls are rendered the same way after its text;
- `tool` messages become a user turn of <tool_response>...</tool_response> blocks (consecutive ones merged).
The model's output is read back by the same rule: every complete <tool_call> block whose JSON names a given
tool with an object of arguments is a call; anything else stays text. Whitespace around calls is formatting.

In "auto" the model may answer in text instead of calling; `tool_choice` "required" or a named function decode
under a grammar (adaptive_eagle/grammar.py, `call_format`) that admits exactly one call whose arguments match the
tool's schema, so the call always parses.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict

MAX_TOOLS = 128
MAX_TOOLS_BYTES = 64 << 10  # the tools' JSON, all together
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARALLEL_CALLS = 4  # the most calls a required or named tool_choice admits with parallel_tool_calls (grammar.py)


class ToolError(ValueError):
    """A request's tools or tool history were refused: `param` names the field, the message says why."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message


# ---- request models (the chat body's fields) ---------------------------------------------------------
class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDef(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class CallFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as the OpenAI API sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CallFunction


class ChoiceFunction(BaseModel):
    name: str


class NamedChoice(BaseModel):
    type: Literal["function"]
    function: ChoiceFunction


ToolChoice = Union[Literal["auto", "none", "required"], NamedChoice]


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools once checked. choice: "auto" | "none" (no call parsed, none offered) | "required" (one
    call to any tool, constrained: call_format) | "function" (one call to `forced`, constrained)."""

    tools: tuple[dict, ...]  # {"type": "function", "function": {...}} as the client sent them (extras dropped)
    choice: str
    parallel: bool
    forced: Optional[str] = None  # the function a named tool_choice calls

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"


def check_tools(tools: Optional[list[ToolDef]], choice: Optional[ToolChoice], parallel: Optional[bool]) -> ToolSpec:
    """The request's ToolSpec, or a ToolError naming the field: names unique and well formed, parameters a JSON
    Schema for an object, the whole under MAX_TOOLS and MAX_TOOLS_BYTES, a tool_choice that can be served."""
    from jsonschema import SchemaError, validators

    tools = list(tools or [])
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    size = len(json.dumps(dumped))
    if size > MAX_TOOLS_BYTES:
        raise ToolError("tools", f"the tools' JSON is {size} bytes; at most {MAX_TOOLS_BYTES}")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        name, params = t.function.name, t.function.parameters
        if not NAME.match(name):
            raise ToolError(f"tools.{i}.function.name", f"{name!r} is not a function name: 1-64 characters of "
                                                        "a-z, A-Z, 0-9, _ and -")
        if name in seen:
            raise ToolError(f"tools.{i}.function.name", f"{name!r} is defined twice")
        seen.add(name)
        if params is not None:
            try:
                validators.validator_for(params).check_schema(params)
            except SchemaError as e:
                raise ToolError(f"tools.{i}.function.parameters", f"not a valid JSON Schema: {e.message}") from None
            except Exception as e:  # noqa: BLE001 - an odd $schema (a list, an unknown URI's lookup) is bad input
                raise ToolError(f"tools.{i}.function.parameters", f"not a valid JSON Schema: {type(e).__name__}: "
                                                                  f"{e}") from None
            if params.get("type", "object") != "object":
                raise ToolError(f"tools.{i}.function.parameters", "must describe an object (\"type\": \"object\"): "
                                                                  f"arguments are named, got type {params['type']!r}")
    parallel = True if parallel is None else bool(parallel)
    if isinstance(choice, NamedChoice):
        if choice.function.name not in seen:
            raise ToolError("tool_choice.function.name", f"no tool named {choice.function.name!r} (tools: "
                                                          f"{', '.join(sorted(seen)) or 'none given'})")
        return ToolSpec(tuple(dumped), "function", parallel, choice.function.name)
    if choice == "required" and not tools:
        raise ToolError("tool_choice", "\"required\" needs tools")
    return ToolSpec(tuple(dumped), choice or "auto", parallel)


def call_format(spec: Optional[ToolSpec]) -> Optional[dict]:
    """The grammar a call-promising tool_choice decodes under (adaptive_eagle/grammar.py's "tool_call"): calls in
    the hermes format to any tool ("required") or to the named one, arguments matching the tool's parameters;
    with parallel_tool_calls, one to PARALLEL_CALLS of them (one a line), else exactly one. None for "auto" and
    "none"."""
    if spec is None or spec.choice not in ("required", "function"):
        return None
    options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                 "arguments": t["function"].get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in spec.tools if spec.choice == "required" or t["function"]["name"] == spec.forced]
    return {"type": "tool_call", "json_schema": {"schema": options[0] if len(options) == 1 else {"anyOf": options}},
            "max_calls": PARALLEL_CALLS if spec.parallel else 1}


def check_history(messages: list) -> None:
    """Every `tool` message answers a call an earlier assistant message made (tool_call_id), and carries text;
    tool-call ids are unique."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        for j, call in enumerate(m.tool_calls or []):
            if m.role != "assistant":
                raise ToolError(f"messages.{i}.tool_calls", "only assistant messages carry tool calls")
            if call.id in calls:
                raise ToolError(f"messages.{i}.tool_calls.{j}.id", f"{call.id!r} is used by an earlier call")
            calls.add(call.id)
        if m.role == "tool":
            if not m.tool_call_id:
                raise ToolError(f"messages.{i}.tool_call_id", "a tool message must name the call it answers")
            if m.tool_call_id not in calls:
                raise ToolError(f"messages.{i}.tool_call_id", f"{m.tool_call_id!r} matches no earlier tool call"
                                                              f" (calls so far: {', '.join(sorted(calls)) or 'none'})")
        elif m.tool_call_id is not None:
            raise ToolError(f"messages.{i}.tool_call_id", "only tool messages answer a call")


# ---- rendering ------------------------------------------------------------------------------------
def wire_messages(messages: list[tuple[str, str, Any, Optional[str]]]) -> tuple[dict[str, str], ...]:
    """Chat messages (role, text, tool_calls or None, tool_call_id or None) as a DecodeRequest carries them to a
    replica: {role, content}, an assistant's calls as "tool_calls" (JSON text of [{id, type, function: {name,
    arguments}}]), and a tool message's "tool_call_id". The replica renders them for its target's template
    (`chat_prompt`)."""
    out = []
    for role, text, calls, call_id in messages:
        m = {"role": role, "content": text}
        if calls:
            m["tool_calls"] = json.dumps([c.model_dump() for c in calls], ensure_ascii=False)
        if call_id is not None:
            m["tool_call_id"] = call_id
        out.append(m)
    return tuple(out)


def wire_tools(spec: Optional[ToolSpec]) -> Optional[str]:
    """The tools a replica renders into the prompt, as JSON text {"tools": [...], "parallel": bool}; None when
    the request offers none (no tools, or tool_choice "none")."""
    if spec is None or not spec.active:
        return None
    return json.dumps({"tools": list(spec.tools), "parallel": spec.parallel}, ensure_ascii=False)


@dataclass(frozen=True)
class ChatPrompt:
    """What a target's chat template takes for one request: its messages, the tools to pass as
    apply_chat_template(tools=...) (None: none, or already rendered into the messages), and what each message is
    (adaptive_eagle.trace.SPAN_KINDS: its role, "tools" for the one carrying the tool schemas, "tool_output")."""

    messages: tuple[dict, ...]
    tools: Optional[list[dict]]
    kinds: tuple[str, ...]

    @property
    def native(self) -> bool:
        return self.tools is not None


PROBE_TOOL = {"type": "function", "function": {"name": "probe_lookup_7f3a", "description": "probe 7f3a tool",
                                               "parameters": {"type": "object", "properties": {}}}}
_SPEAKS: dict[str, bool] = {}  # chat template -> whether it speaks hermes


def speaks_hermes(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tools itself in the hermes format (Qwen2.5, Hermes and
    their kin): given tools, an assistant call and a tool result, its text holds the tool's schema, the call in
    <tool_call> tags and the result in <tool_response> tags. Decided once per template, by rendering a probe."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        return False
    if template not in _SPEAKS:
        probe = [{"role": "user", "content": "probe question"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"type": "function", "function": {"name": "probe_lookup_7f3a", "arguments": {}}}]},
                 {"role": "tool", "content": "probe result 7f3a"}]
        try:
            text = tokenizer.apply_chat_template(probe, tools=[PROBE_TOOL], tokenize=False,
                                                 add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that cannot render tools does not speak them
            text = ""
        _SPEAKS[template] = (isinstance(text, str) and "probe 7f3a tool" in text and "<tool_response>" in text
                             and re.search(r"<tool_call>\s*\{\s*\"name\": \"probe_lookup_7f3a\"", text) is not None)
    return _SPEAKS[template]


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # what the client sent back, as text


def chat_prompt(tokenizer, messages, tools: Optional[str]) -> ChatPrompt:
    """A request's wire messages and tools (`wire_messages`, `wire_tools`) as its target's template takes them.
    A template that speaks the hermes tool format (`speaks_hermes`) renders them itself: calls and tool
    messages in the Hugging Face form, the tools passed as `tools=`. Any other template (SmolLM2's ChatML has no
    tool support) gets plain role/content messages in the hermes format (the module docstring)."""
    offered = json.loads(tools) if tools else None
    if offered is not None and tokenizer is not None and speaks_hermes(tokenizer):
        out, kinds = [], []
        for m in messages:
            native = {"role": m["role"], "content": m["content"]}
            if m.get("tool_calls"):
                native["tool_calls"] = [{"type": "function", "function": {
                    "name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
                    for c in json.loads(m["tool_calls"])]
            if m.get("tool_call_id"):
                native["tool_call_id"] = m["tool_call_id"]
            out.append(native)
            kinds.append("tool_output" if m["role"] == "tool" else m["role"])
        kinds[0] = "tools"  # the template writes the tools into its first block
        return ChatPrompt(tuple(out), list(offered["tools"]), tuple(kinds))
    out, kinds = [], []
    for m in messages:
        role, text = m["role"], m["content"]
        if role == "assistant" and m.get("tool_calls"):
            calls = json.loads(m["tool_calls"])
            parts = ([text] if text else []) + [render_call(c["function"]["name"], c["function"]["arguments"])
                                                for c in calls]
            out.append({"role": "assistant", "content": "\n".join(parts)})
            kinds.append("assistant")
        elif role == "tool":
            block = f"<tool_response>\n{text}\n</tool_response>"
            if kinds and kinds[-1] == "tool_output":
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block})
                kinds.append("tool_output")
        else:
            out.append({"role": role, "content": text})
            kinds.append(role)
    if offered is not None:
        block = system_block(offered["tools"], offered["parallel"])
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
            kinds[0] = "tools"
        else:
            out.insert(0, {"role": "system", "content": block})
            kinds.insert(0, "tools")
    return ChatPrompt(tuple(out), None, tuple(kinds))


class TemplateError(ValueError):
    """The target's chat template refused a request's messages (a 400: the message says what it raised)."""


def template_ids(tokenizer, prompt: ChatPrompt, add_generation_prompt: bool = True) -> list[int]:
    """The prompt's token ids under the tokenizer's chat template; TemplateError when the template refuses them."""
    kw = {"tools": prompt.tools} if prompt.native else {}
    try:
        out = tokenizer.apply_chat_template([dict(m) for m in prompt.messages], tokenize=True,
                                            add_generation_prompt=add_generation_prompt, **kw)
    except Exception as e:  # noqa: BLE001 - a Jinja template raises what its author wrote (TemplateError and kin)
        raise TemplateError(f"the target's chat template refused these messages: {type(e).__name__}: {e}") from None
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(t) for t in ids]


def system_block(tools: list[dict], parallel: bool) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    once = "" if parallel else " Call at most one function per turn."
    return ("# Tools\n\nYou may call one or more functions to assist with the user query." + once + "\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + lines +
            "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def render_call(name: str, arguments: str) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': _arguments(arguments)}, ensure_ascii=False)}\n{CLOSE}"


# ---- parsing ----------------------------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallStream:
    """The model's text, fed as it decodes, split into text to show and tool calls. `feed` and `close` return
    events: ("text", str) or ("call", {"id", "type", "function": {"name", "arguments"}}). Text that could be the
    start of a call is held back until it is known not to be; whitespace next to a call is dropped. Parsing a
    whole text is feeding it once and closing (`parse`), so a stream assembles to the non-streamed answer."""

    def __init__(self, spec: ToolSpec) -> None:
        self.names, self.parallel = spec.names, spec.parallel
        self.buf = ""  # undecided text: a partial OPEN, or a call not closed yet
        self.space = ""  # whitespace held back: formatting if a call follows
        self.calls = 0

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        out: list[tuple[str, Any]] = []
        while True:
            start = self.buf.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self.buf, OPEN)
                self._text(self.buf[:len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            self._text(self.buf[:start], out)
            self.buf = self.buf[start:]
            end = _close_at(self.buf)
            if end < 0:
                return out
            block, self.buf = self.buf[:end + len(CLOSE)], self.buf[end + len(CLOSE):]
            call = self._call(block[len(OPEN):-len(CLOSE)])
            if call is None:
                self._text(block, out)
            else:
                self.space = ""  # formatting between text and a call
                self.calls += 1
                if self.parallel or self.calls == 1:
                    out.append(("call", call))
                self.buf = self.buf.lstrip()

    def close(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        self._text(self.buf, out)  # an unclosed call is text
        self.buf = ""
        if self.space and not self.calls:
            out.append(("text", self.space))
        self.space = ""
        return out

    def _text(self, text: str, out: list) -> None:
        if not text:
            return
        body = text.rstrip()
        if not body:
            self.space += text
            return
        out.append(("text", self.space + body))
        self.space = text[len(body):]  # trailing whitespace waits: formatting if a call comes next

    def _call(self, body: str) -> Optional[dict]:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, dict):
            return None
        return {"id": new_call_id(), "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _close_at(buf: str) -> int:
    """Index of the CLOSE that ends the call opened at buf[0], or -1: the first CLOSE outside a JSON string (a
    string argument may hold the marker's text itself: the grammar allows any string)."""
    end = buf.find(CLOSE, len(OPEN))
    while end >= 0 and _in_string(buf[len(OPEN):end]):
        end = buf.find(CLOSE, end + 1)
    return end


def _in_string(text: str) -> bool:
    """Whether JSON text cut at its end stops inside a string (quotes counted, escapes skipped)."""
    inside = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\" and inside:
            escaped = True
        elif ch == '"':
            inside = not inside
    return inside


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def parse(text: str, spec: ToolSpec) -> tuple[Optional[str], list[dict]]:
    """(content, calls) of a whole answer: content None when the answer is only calls."""
    stream = CallStream(spec)
    events = stream.feed(text) + stream.close()
    content = "".join(v for k, v in events if k == "text")
    calls = [v for k, v in events if k == "call"]
    return (content or None) if calls else content, calls


__all__ = ["CallStream", "ChatPrompt", "MAX_TOOLS", "MAX_TOOLS_BYTES", "NamedChoice", "TemplateError", "ToolCall",
           "ToolChoice", "ToolDef", "ToolError", "ToolSpec", "call_format", "chat_prompt", "check_history",
           "check_tools", "parse", "speaks_hermes", "template_ids", "wire_messages", "wire_tools"]
