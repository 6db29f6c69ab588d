"""Tool calling on the chat endpoint: the checks on tools and tool history (400s naming the field), the hermes
rendering, the parser (whole answers and streams alike), and the gateway through the official openai client.

The tiny word-level target cannot write a tool call, so the gateway tests use ScriptedReplica (test code): a real
replica decodes each request, and its text is replaced by a script the test chose; it also keeps the request it
was given, so the tests see what the template received."""

import dataclasses
import json

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.capture import CapturePolicy
from serving.gateway import GatewayThread, create_app
from serving.messages import Delta, Finished
from serving.openai_api import ApiError, parse_chat
from serving.router import LocalReplica
from serving.server import DecodeServer
from serving.tools import (MAX_TOOLS, PARALLEL_CALLS, CallStream, NamedChoice, ToolDef, ToolSpec, call_format,
                           chat_prompt, check_tools, parse)
from tests.serving.test_gateway import KEY, MODEL, config

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {
    "expr": {"type": "string"}}}}}
SPEC = ToolSpec((WEATHER, CALC), "auto", True)


def call_text(name, args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def body(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], **kw}


# ---- checks ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tools, choice, param, words", [
    ([{**WEATHER, "function": {**WEATHER["function"], "name": "bad name!"}}], None, "tools.0.function.name",
     "not a function name"),
    ([WEATHER, WEATHER], None, "tools.1.function.name", "defined twice"),
    ([{**CALC, "function": {"name": "calc", "parameters": {"type": "object", "properties": 3}}}], None,
     "tools.0.function.parameters", "not a valid JSON Schema"),
    ([{**CALC, "function": {"name": "calc", "parameters": {"type": "string"}}}], None,
     "tools.0.function.parameters", "must describe an object"),
    ([{**CALC, "function": {"name": "calc", "parameters": {"$schema": [1], "type": "object"}}}], None,
     "tools.0.function.parameters", "not a valid JSON Schema"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name",
     "no tool named 'nope'"),
    ([], "required", "tool_choice", "needs tools"),
    ([CALC] * (MAX_TOOLS + 1), None, "tools", f"at most {MAX_TOOLS} tools"),
])
def test_bad_tools_and_choices_are_refused_naming_the_field(tools, choice, param, words):
    with pytest.raises(ApiError) as err:
        parse_chat(body(tools=tools, tool_choice=choice), 64, 16)
    assert err.value.status == 400 and err.value.param == param and words in err.value.message


@pytest.mark.parametrize("messages, param, words", [
    ([{"role": "user", "content": "w5"}, {"role": "tool", "tool_call_id": "call_x", "content": "18C"}],
     "messages.1.tool_call_id", "matches no earlier tool call"),
    ([{"role": "tool", "content": "18C"}], "messages.0.tool_call_id", "must name the call"),
    ([{"role": "user", "content": "w5", "tool_call_id": "call_x"}], "messages.0.tool_call_id", "only tool messages"),
    ([{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc",
                                                                                           "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": ""}], "messages.1.content", "must carry the tool's result"),
])
def test_a_bad_tool_history_is_refused_naming_the_message(messages, param, words):
    with pytest.raises(ApiError) as err:
        parse_chat({"model": MODEL, "messages": messages, "tools": [CALC]}, 64, 16)
    assert err.value.status == 400 and err.value.param == param and words in err.value.message


@pytest.mark.parametrize("fmt, param, words", [
    ({"type": "yaml"}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
    ({"type": "json_schema"}, "response_format.json_schema", "JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}},
     "response_format.json_schema.schema", "not a valid JSON Schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["x" * 70000]}}},
     "response_format.json_schema.schema", "at most"),
])
def test_a_bad_response_format_is_refused_naming_the_field(fmt, param, words):
    with pytest.raises(ApiError) as err:
        parse_chat(body(response_format=fmt), 64, 16)
    assert err.value.status == 400 and err.value.param == param and words in err.value.message


def test_a_response_format_reaches_the_replica_as_the_grammar_to_serve():
    assert parse_chat(body(response_format={"type": "text"}), 64, 16)[1].response_format is None
    _, req = parse_chat(body(response_format={"type": "json_object"}), 64, 16)
    assert json.loads(req.response_format) == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    _, req = parse_chat(body(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "strict": True, "schema": schema}}), 64, 16)
    assert json.loads(req.response_format) == {"type": "json_schema", "json_schema": {"schema": schema,
                                                                                        "strict": True}}


# ---- rendering -------------------------------------------------------------------------------------------
def test_tools_and_tool_turns_render_as_chat_messages_any_template_takes():
    b, req = parse_chat({"model": MODEL, "tools": [WEATHER, CALC], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "3C"}]}, 64, 16)
    assert req.messages[3] == {"role": "tool", "content": "18C", "tool_call_id": "c1"}  # carried as sent
    chat = chat_prompt(None, req.messages, req.tools)  # no template of its own: the hermes rendering
    roles = [m["role"] for m in chat.messages]
    assert roles == ["system", "user", "assistant", "user"] and chat.tools is None  # two results: one user turn
    assert chat.kinds == ("tools", "user", "assistant", "tool_output")
    system = chat.messages[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in system and "<tool_call>" in system
    assert chat.messages[2]["content"] == (call_text("get_weather", {"city": "Paris"}) + "\n" +
                                           call_text("get_weather", {"city": "Oslo"}))
    assert chat.messages[3]["content"] == ("<tool_response>\n18C\n</tool_response>\n<tool_response>\n3C\n"
                                           "</tool_response>")
    assert b.tool_spec.names == {"get_weather", "calc"}


def test_tool_choice_none_offers_no_tools_and_parses_no_calls():
    b, req = parse_chat(body(tools=[WEATHER], tool_choice="none"), 64, 16)
    assert not b.tool_spec.active and req.tools is None
    assert all("# Tools" not in m["content"] for m in chat_prompt(None, req.messages, req.tools).messages)
    b, req = parse_chat(body(), 64, 16)
    assert b.tool_spec is None and req.messages == ({"role": "user", "content": "w5"},)


# ---- parsing ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, content, calls", [
    ("Paris is sunny.", "Paris is sunny.", []),
    (call_text("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n" + call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("calc", {"expr": "1+1"}),
     "Let me check.", [("get_weather", {"city": "Paris"}), ("calc", {"expr": "1+1"})]),
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),  # not a call: text
    (call_text("unknown_tool", {}), call_text("unknown_tool", {}), []),
    ("<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"expr\"", "<tool_call>\n{\"name\": \"calc\", "
     "\"arguments\": {\"expr\"", []),  # cut off by max_tokens
    ("a < b <tool_ and <tool_call", "a < b <tool_ and <tool_call", []),
    # a string argument may hold the closing marker (the call grammar allows any string): it stays in the string
    (call_text("calc", {"expr": "}}</tool_call> 6*7"}) + " done", "done", [("calc", {"expr": "}}</tool_call> 6*7"})]),
    (call_text("calc", {"expr": "a \\\" </tool_call>"}), None, [("calc", {"expr": "a \\\" </tool_call>"})]),
])
def test_an_answer_is_split_into_text_and_calls(text, content, calls):
    got_content, got = parse(text, SPEC)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got)
    assert len({c["id"] for c in got}) == len(got)


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = call_text("calc", {"expr": "1"}) + call_text("calc", {"expr": "2"})
    _, calls = parse(text, dataclasses.replace(SPEC, parallel=False))
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"expr": "1"}]


PIECES = st.sampled_from(["Sure", " ", "\n", "<", "tool", "_call", ">", "</tool_call>", "<tool_call>", '"', "\\",
                          json.dumps({"name": "calc", "arguments": {"expr": "2*3"}}),
                          json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}}), "{", "x"])


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=14), st.data())
def test_a_stream_assembles_to_the_whole_answer_however_it_is_cut(pieces, data):
    text = "".join(pieces)
    content, calls = parse(text, SPEC)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    stream, events = CallStream(SPEC), []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        events += stream.feed(text[a:b])
    events += stream.close()
    streamed_text = "".join(v for k, v in events if k == "text")
    streamed = [v["function"] for k, v in events if k == "call"]
    assert (streamed_text or None) == (content or None) if calls else streamed_text == content
    assert streamed == [c["function"] for c in calls]


def test_check_tools_defaults_to_auto_and_parallel_calls():
    spec = check_tools([ToolDef.model_validate(WEATHER)], None, None)
    assert spec.active and spec.parallel and spec.choice == "auto" and call_format(spec) is None


def test_required_and_named_choices_decode_under_a_call_grammar_of_one_or_parallel_calls():
    tools = [ToolDef.model_validate(WEATHER), ToolDef.model_validate(CALC)]
    named = check_tools(tools, NamedChoice.model_validate({"type": "function", "function": {"name": "calc"}}), None)
    fmt = call_format(named)
    assert fmt["type"] == "tool_call" and fmt["json_schema"]["schema"]["properties"]["name"] == {"const": "calc"}
    assert fmt["json_schema"]["schema"]["properties"]["arguments"] == CALC["function"]["parameters"]
    required = call_format(check_tools(tools, "required", False))
    assert [o["properties"]["name"]["const"] for o in required["json_schema"]["schema"]["anyOf"]] == [
        "get_weather", "calc"]
    assert required["max_calls"] == 1 and fmt["max_calls"] == PARALLEL_CALLS  # parallel_tool_calls: default true
    _, req = parse_chat(body(tools=[WEATHER, CALC], tool_choice="required", parallel_tool_calls=False), 64, 16)
    assert json.loads(req.response_format) == required
    _, req = parse_chat(body(tools=[WEATHER, CALC], tool_choice="required"), 64, 16)
    assert json.loads(req.response_format) == {**required, "max_calls": PARALLEL_CALLS}
    with pytest.raises(ApiError) as err:
        parse_chat(body(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), 64, 16)
    assert err.value.param == "response_format" and "cannot both" in err.value.message


# ---- through the gateway -------------------------------------------------------------------------------
class ScriptedReplica(LocalReplica):
    """A real replica whose text is replaced by `script` (test code: the tiny target cannot write calls)."""

    def __init__(self, server, script: list[str]) -> None:
        super().__init__(server)
        self.script, self.requests = script, []

    async def stream(self, request):
        self.requests.append(request)
        async for event in self.server.astream(request):
            if isinstance(event, Delta):
                continue
            if isinstance(event, Finished):
                for piece in self.script:
                    yield Delta(piece)
                event = dataclasses.replace(event, text="".join(self.script), finish_reason="stop")
            yield event


SCRIPT = ["I will", " look.\n<tool", "_call>\n", json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}),
          "\n</tool_call>\n<tool_call>\n", json.dumps({"name": "calc", "arguments": {"expr": "6*7"}}), "\n</tool_call>"]


@pytest.fixture(scope="module")
def scripted(stack):
    # the tools' JSON is hundreds of unknown words to the tiny word tokenizer
    server = DecodeServer(stack.backend("v1", max_prompt_tokens=480), CapturePolicy(enabled=False), None,
                          name="replica-0")
    replica = ScriptedReplica(server, SCRIPT)
    app = create_app(config(replicas=1, max_prompt_tokens=480), [replica])
    thread = GatewayThread(app)
    url = thread.start()
    yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60), replica
    thread.stop()
    replica.server.close()


def test_the_openai_client_gets_tool_calls_whole_and_streamed(scripted):
    client, replica = scripted
    args = dict(model=MODEL, messages=[{"role": "user", "content": "w5 w6"}], tools=[WEATHER, CALC],
                temperature=0, max_tokens=8)
    resp = client.chat.completions.create(**args)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will look."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"}), ("calc", {"expr": "6*7"})]
    assert json.loads(replica.requests[-1].tools)["tools"] == [WEATHER, CALC]  # the tools reached the replica

    chunks = list(client.chat.completions.create(**args, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assembled: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            slot = assembled.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            slot["id"] = d.id or slot["id"]
            slot["name"] = (d.function.name if d.function and d.function.name else slot["name"])
            slot["arguments"] += (d.function.arguments or "") if d.function else ""
    assert text == "I will look." and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(s["name"], json.loads(s["arguments"])) for _, s in sorted(assembled.items())] == calls
    assert all(s["id"].startswith("call_") for s in assembled.values())

    # the agent sends the calls and their results back: accepted, and rendered for the next turn
    history = args["messages"] + [choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "42"} for c in choice.message.tool_calls]
    client.chat.completions.create(**{**args, "messages": history})
    sent = replica.requests[-1]
    assert chat_prompt(None, sent.messages, sent.tools).messages[-1]["content"].count("<tool_response>") == 2
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{**args, "messages": history[:1] + history[2:]})
    assert err.value.body["param"] == "messages.1.tool_call_id"


def test_a_format_the_models_tokenizer_cannot_spell_is_a_400_before_decoding(scripted):
    client, _ = scripted  # the tiny word-level tokenizer has no token that starts a JSON object
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=8,
                                       response_format={"type": "json_object"})
    assert err.value.body["param"] == "response_format" and "cannot write it" in err.value.body["message"]


def test_a_required_call_the_tokenizer_cannot_spell_is_a_400_before_decoding(scripted):
    client, _ = scripted
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=8,
                                       tools=[CALC], tool_choice="required")
    assert err.value.body["param"] == "tool_choice" and "cannot write it" in err.value.body["message"]


def test_without_tools_the_same_text_is_plain_content(scripted):
    client, _ = scripted
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], temperature=0,
                                          max_tokens=8)
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].message.tool_calls is None
    assert resp.choices[0].message.content == "".join(SCRIPT)


# ---- what a captured tool turn records -------------------------------------------------------------------
def test_a_captured_tool_turn_records_which_tokens_are_schemas_tool_output_and_model_text(stack):
    from adaptive_eagle.spans import answer_span
    from serving.backend import generate

    history = [{"role": "user", "content": "w5 w6"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": "{\"expr\": \"w7\"}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "w8 w9"}]
    _, request = parse_chat(body(messages=history, tools=[CALC], max_tokens=4, temperature=0), 64, 16)
    backend = stack.backend("v1", max_prompt_tokens=480)
    trace = generate(backend, request, capture=True).trace
    prompt = len(trace.input_ids) - sum(trace.loss_mask)
    assert [k for _, _, k in trace.spans] == ["tools", "user", "assistant", "tool_output", "model"]
    assert trace.spans[0][0] == 0 and trace.spans[3][1] <= prompt and trace.spans[-1] == (prompt, len(trace.input_ids),
                                                                                        "model")
    assert all(a[1] == b[0] for a, b in zip(trace.spans[:3], trace.spans[1:4]))  # the messages tile the prompt
    assert generate(backend, request.model_copy(update={"capture": False}), capture=True).trace.spans[:-1] == ()
    assert answer_span(5, 9, True) == ((5, 9, "constrained"),) and answer_span(5, 5, False) == ()
    from serving.messages import DecodeRequest

    with pytest.raises(ValueError, match="give messages with them"):
        DecodeRequest(request_id="r", prompt="w5", tools=request.tools)


def test_an_sglang_trace_marks_a_constrained_answer():
    from serving.messages import DecodeRequest
    from serving.sglang_backend import trace_from_response

    req = DecodeRequest(request_id="r1", prompt=(1, 2, 3), response_format='{"type": "json_object"}')
    trace = trace_from_response(req, [1, 2, 3], [4, 5], {}, "v1", "fp", 3)
    assert trace.spans == ((3, 5, "constrained"),)


def test_a_template_that_refuses_a_prefix_gives_no_spans_and_never_fails():
    from adaptive_eagle.spans import message_spans

    class Strict:  # test code: a template that only takes whole conversations ending with a user turn
        def apply_chat_template(self, messages, **kw):
            if messages[-1]["role"] != "user":
                raise ValueError("roles must alternate")
            return list(range(3 * len(messages)))

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert message_spans(Strict(), msgs, None, list(range(6))) == ()
    assert message_spans(Strict(), msgs[1:], None, [0, 1, 2, 9]) == ((0, 3, "user"),)


# ---- a target whose own template renders tools ----------------------------------------------------------
# test code: a chat template in the hermes format (the tools' JSON in <tools>, calls in <tool_call> tags, results
# in <tool_response> tags), as Qwen2.5's and Hermes' templates write it, for the word-level tokenizer
HERMES_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> {% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls is defined and m.tool_calls -%}"
    "{{ m.content }}{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call> {% endfor %}"
    "{%- elif m.role == 'tool' -%}<tool_response> {{ m.content }} </tool_response> "
    "{%- else -%}{{ m.content }} {% endif -%}"
    "{%- endfor -%}")
# another family's format (calls as [CALLS] JSON): it takes tools, but not in the format the parser reads
OTHER_TEMPLATE = ("{%- if tools %}[TOOLS]{{ tools | tojson }}[/TOOLS] {% endif -%}{%- for m in messages -%}"
                  "{%- if m.tool_calls is defined and m.tool_calls %}[CALLS]{{ m.tool_calls | tojson }} "
                  "{%- else %}{{ m.content }} {% endif -%}{%- endfor -%}")
HISTORY = [{"role": "user", "content": "w5 w6"},
           {"role": "assistant", "content": "w7", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": "{\"expr\": \"w7\"}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "w8 w9"}]


def _tokenizer(template):
    from tests.serving.conftest import word_tokenizer

    tok = word_tokenizer()
    tok.chat_template = template
    return tok


def test_only_a_template_that_writes_the_hermes_format_renders_tools_itself():
    from serving.tools import speaks_hermes

    assert speaks_hermes(_tokenizer(HERMES_TEMPLATE))
    assert not speaks_hermes(_tokenizer(OTHER_TEMPLATE))  # takes tools, writes another format
    from tests.serving.conftest import word_tokenizer
    assert not speaks_hermes(word_tokenizer())  # no tools at all: the documented hermes rendering
    _, req = parse_chat(body(messages=HISTORY, tools=[CALC], max_tokens=4), 64, 16)
    other = chat_prompt(_tokenizer(OTHER_TEMPLATE), req.messages, req.tools)
    assert other == chat_prompt(None, req.messages, req.tools)


def test_a_template_that_speaks_hermes_gets_the_tools_and_the_history_in_the_hugging_face_form():
    from serving.tools import template_ids

    tok = _tokenizer(HERMES_TEMPLATE)
    _, req = parse_chat(body(messages=HISTORY, tools=[WEATHER, CALC], max_tokens=4), 64, 16)
    chat = chat_prompt(tok, req.messages, req.tools)
    assert chat.native and chat.tools == [WEATHER, CALC] and chat.kinds == ("tools", "assistant", "tool_output")
    by_hand = [{"role": "user", "content": "w5 w6"},
               {"role": "assistant", "content": "w7", "tool_calls": [
                   {"type": "function", "function": {"name": "calc", "arguments": {"expr": "w7"}}}]},
               {"role": "tool", "content": "w8 w9", "tool_call_id": "call_1"}]
    assert template_ids(tok, chat) == tok.apply_chat_template(by_hand, tools=[WEATHER, CALC], tokenize=True,
                                                              add_generation_prompt=True)["input_ids"]
    text = tok.apply_chat_template(list(chat.messages), tools=chat.tools, tokenize=False)
    assert "<tool_call>{\"name\": \"calc\", \"arguments\": {\"expr\": \"w7\"}}</tool_call>" in text
    assert text.startswith("<tools>") and "<tool_response> w8 w9 </tool_response>" in text
    _, plain = parse_chat(body(messages=HISTORY[:1], max_tokens=4), 64, 16)  # no tools: nothing native
    assert not chat_prompt(tok, plain.messages, plain.tools).native


def test_a_replica_whose_target_renders_tools_itself_decodes_and_captures_that_prompt(stack):
    from dataclasses import replace

    from adaptive_eagle.engine import SpeculativeEngine
    from serving.backend import ReferenceBackend, generate
    from serving.tools import template_ids
    from tests.serving.conftest import ENGINE

    tok = _tokenizer(HERMES_TEMPLATE)
    target = replace(stack.target, tokenizer=tok)
    backend = ReferenceBackend(SpeculativeEngine(target, stack.registry.load("v1", target), ENGINE, head_version="v1"),
                               stack.registry, 480)
    _, req = parse_chat(body(messages=HISTORY, tools=[CALC], max_tokens=4, temperature=0), 64, 16)
    trace = generate(backend, req, capture=True).trace
    prompt = len(trace.input_ids) - sum(trace.loss_mask)
    assert list(trace.input_ids[:prompt]) == template_ids(tok, chat_prompt(tok, req.messages, req.tools))
    assert [k for _, _, k in trace.spans] == ["tools", "assistant", "tool_output", "model"]
    assert trace.spans[0][0] == 0 and trace.spans[2][1] <= prompt
    assert all(a[1] == b[0] for a, b in zip(trace.spans[:2], trace.spans[1:3]))  # the messages tile the prompt


def test_a_template_that_refuses_the_messages_is_a_400_naming_them(stack):
    from dataclasses import replace

    from adaptive_eagle.engine import SpeculativeEngine
    from serving.backend import ReferenceBackend, RequestError
    from tests.serving.conftest import ENGINE

    tok = _tokenizer(HERMES_TEMPLATE.replace("{%- else -%}", "{%- else -%}{% if 'w6' in m.content %}"
                                             "{{ raise_exception('no w6 here') }}{% endif %}"))
    target = replace(stack.target, tokenizer=tok)
    backend = ReferenceBackend(SpeculativeEngine(target, None, ENGINE), stack.registry, 480)
    _, req = parse_chat(body(messages=HISTORY, tools=[CALC], max_tokens=4), 64, 16)
    with pytest.raises(RequestError) as err:
        backend.prepare(req)
    assert err.value.param == "messages" and "no w6 here" in str(err.value)
