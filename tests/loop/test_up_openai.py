"""An agent's calls against `adaptive-eagle up` on the real target (SmolLM2-135M-Instruct, the shipped head, the
default engine), through the official `openai` client: tools under every tool_choice, a history with the
assistant's calls and the tools' results, a streamed call that assembles to the whole one, and JSON outputs
(json_object, strict json_schema) that parse and validate, greedy and sampled. One process, started as a user
starts it, stopped with SIGTERM."""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import jsonschema
import openai
import pytest
import xgrammar as xgr
import yaml
from xgrammar.testing import _is_grammar_accept_string

from adaptive_eagle.cli import SHIPPED_HEAD
from serving.tools import PARALLEL_CALLS

pytestmark = pytest.mark.slow

MODEL = "adaptive-eagle"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 40}},
                   "required": ["expression"], "additionalProperties": False}}}
TOOLS = [WEATHER, CALC]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 24},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                          "member": {"type": "boolean"}},
          "required": ["name", "age", "member"], "additionalProperties": False}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("up")
    config = tmp / "stack.yaml"
    config.write_text(yaml.safe_dump({
        "state_dir": str(tmp / "state"),
        "ray": {"num_cpus": 2, "dashboard": False, "replica_num_cpus": 0},
        "registry": {"seed_head": str(SHIPPED_HEAD)},
        "serving": {"model_name": MODEL, "max_prompt_tokens": 1024, "max_tokens_limit": 160, "default_max_tokens": 32,
                    "capture": {"fraction": 0.0}},
        "store": {"fsync": False},
        "trainer": {"num_cpus": 0, "device": "cpu"},
    }))
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "adaptive_eagle_cli", "up", "--config", str(config), "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen, deadline = [], time.monotonic() + 300  # the deadline only stops a hung start
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            continue
        if seen[-1].startswith("serving;"):
            break
    assert seen and seen[-1].startswith("serving;"), "".join(seen)
    yield f"http://127.0.0.1:{port}/v1"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert "stopped." in "".join(rest), "".join(seen + rest)


@pytest.fixture(scope="module")
def client(endpoint):
    return openai.OpenAI(base_url=endpoint, api_key="x", max_retries=0, timeout=300)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _valid(name: str, args: dict) -> bool:
    tool = next(t["function"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(args, tool["parameters"])
    return True


ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather in Paris today?"}]


def test_tools_under_every_tool_choice_and_a_history_with_calls_and_results(client):
    args = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=96)
    required = client.chat.completions.create(**args, tool_choice="required").choices[0]
    calls = _calls(required.message)  # parallel_tool_calls defaults to true: one to PARALLEL_CALLS calls
    assert required.finish_reason == "tool_calls" and 1 <= len(calls) <= PARALLEL_CALLS
    assert all(_valid(*c) for c in calls)
    one = client.chat.completions.create(**args, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert len(_calls(one.message)) == 1 and _valid(*_calls(one.message)[0])
    named = client.chat.completions.create(**args, tool_choice={"type": "function",
                                                                "function": {"name": "calculator"}}).choices[0]
    assert {name for name, _ in _calls(named.message)} == {"calculator"}
    assert all(_valid(*c) for c in _calls(named.message))
    none = client.chat.completions.create(**args, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.message.content and none.finish_reason in ("stop", "length")
    auto = client.chat.completions.create(**args, tool_choice="auto").choices[0]
    assert auto.finish_reason in ("stop", "length", "tool_calls")
    assert all(_valid(*c) for c in _calls(auto.message))  # whatever it chose, a call it made parses

    # the agent runs the call and sends the result back
    history = ASK + [required.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "Sunny, 21 C."} for c in required.message.tool_calls]
    answer = client.chat.completions.create(**{**args, "messages": history}).choices[0]
    assert answer.message.content or answer.message.tool_calls

    # streamed at temperature 0, the call assembles to the non-streamed one
    slots: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**args, tool_choice="required", stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            slot = slots.setdefault(d.index, {"name": "", "arguments": ""})
            slot["name"] += (d.function.name or "") if d.function else ""
            slot["arguments"] += (d.function.arguments or "") if d.function else ""
    assert [(s["name"], json.loads(s["arguments"])) for _, s in sorted(slots.items())] == calls


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 7}, {"temperature": 1.0,
                                                                                             "seed": 11}])
def test_json_outputs_parse_and_validate_greedy_and_sampled(client, sampling):
    ask = [{"role": "user", "content": "Describe a library member as JSON: name, age and whether they are a member."}]
    strict = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=96, **sampling,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    text = strict.choices[0].message.content
    assert strict.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), PERSON)
    obj = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=160, **sampling,
                                         response_format={"type": "json_object"})
    text = obj.choices[0].message.content
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    else:  # any object is unbounded: a sample may still be open at max_tokens, and is then a prefix of one
        assert obj.choices[0].finish_reason == "length" and obj.usage.completion_tokens == 160, text
        grammar = xgr.Grammar.from_json_schema(json.dumps({"type": "object"}), any_whitespace=False, strict_mode=True)
        assert _is_grammar_accept_string(grammar, text, require_termination=False), text
