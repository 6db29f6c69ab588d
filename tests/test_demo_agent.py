"""`adaptive-eagle demo --scenario agent`: the agent loop's tools, tasks and turns, its re-decodes through the
gateway's parser, and the report's count of valid calls (fast; the 15-minute run is under docs/results/)."""

import json
from types import SimpleNamespace

import pytest

from adaptive_eagle_cli.demo import agent
from adaptive_eagle_cli.demo.config import DemoConfig, phase_plan
from adaptive_eagle_cli.demo.control import decode_again
from adaptive_eagle_cli.demo.report import summary, tool_calls
from adaptive_eagle_cli.demo.run import failed_checks
from adaptive_eagle_cli.demo.traffic import Prompt, RequestResult, first_turn, next_turn
from serving.openai_api import parse_chat
from serving.tools import chat_prompt


def test_the_calculator_does_arithmetic_and_nothing_else():
    assert agent.calculate("(3 + 4) * 12") == 84 and agent.calculate("2 ** 10 - 1") == 1023
    assert agent.calculate("-7 / 2") == -3.5
    for bad in ("__import__('os')", "x + 1", "2 ** 999", "[1][0]", "1 +", "open('f')"):
        with pytest.raises(ValueError):
            agent.calculate(bad)


def test_tools_answer_deterministically_and_errors_are_results_never_exceptions():
    box = agent.Toolbox(["Sourdough starters need feeding once a week.", "Python lists are mutable sequences."])
    assert box.run("search", json.dumps({"query": "how are python lists"})) == "Python lists are mutable sequences."
    assert box.run("find_passages", json.dumps({"terms": "sourdough", "top_k": 1, "language": "en"})).startswith("Sour")
    assert box.run("search", json.dumps({"query": "zz"})) == "no passage matches"
    assert box.run("calculator", json.dumps({"expression": "6 * 7"})) == "42"
    assert box.run("evaluate", json.dumps({"formula": "1 / 3", "decimals": 2})) == "0.33"
    assert box.run("memory_set", json.dumps({"key": "cat", "value": "Miso"})) == "stored cat"
    assert box.run("notes", json.dumps({"action": "read", "name": "cat"})) == "Miso"  # one memory per client
    assert box.run("notes", json.dumps({"action": "delete", "name": "cat"})) == "deleted cat"
    assert box.run("memory_get", json.dumps({"key": "cat"})) == "nothing stored under cat"
    assert agent.Toolbox([]).run("memory_get", json.dumps({"key": "cat"})) == "nothing stored under cat"
    assert box.run("calculator", "{not json").startswith("error: the arguments are not JSON")
    assert box.run("calculator", json.dumps({"expression": "1/0"})).startswith("error: ZeroDivisionError")
    assert box.run("calculator", json.dumps({"expr": "1"})).startswith("error: KeyError")
    assert box.run("rm_rf", "{}") == "error: no tool named rm_rf"


def test_a_call_is_valid_when_it_names_a_tool_of_its_set_with_arguments_its_schema_accepts():
    assert agent.call_valid("tools", "calculator", json.dumps({"expression": "1+1"}))
    assert agent.call_valid("tools2", "evaluate", json.dumps({"formula": "1+1", "decimals": 0}))
    assert not agent.call_valid("tools2", "calculator", json.dumps({"expression": "1+1"}))  # the other set's tool
    assert not agent.call_valid("tools2", "evaluate", json.dumps({"formula": "1+1", "decimals": 9}))  # maximum 6
    assert not agent.call_valid("tools", "calculator", json.dumps({"expression": "1+1", "x": 1}))  # no extras
    assert not agent.call_valid("tools", "calculator", json.dumps({"expression": "x" * 49}))  # maxLength 48
    assert not agent.call_valid("tools", "calculator", "{")


def test_the_two_tool_sets_differ_in_every_name_and_each_renders_a_required_call_grammar():
    from serving.tools import ToolDef, call_format, check_tools

    names = [{t["function"]["name"] for t in agent.TOOL_SETS[d]} for d in agent.TOOL_DOMAINS]
    assert not names[0] & names[1]
    for d in agent.TOOL_DOMAINS:
        fmt = call_format(check_tools([ToolDef.model_validate(t) for t in agent.TOOL_SETS[d]], "required", None))
        assert len(fmt["json_schema"]["schema"]["anyOf"]) == len(agent.TOOL_SETS[d])


def test_tasks_are_seeded_and_mix_lookups_arithmetic_and_memory():
    tasks = agent.tasks(["Why is the sky blue?"], 9, seed=3)
    assert tasks == agent.tasks(["Why is the sky blue?"], 9, seed=3) != agent.tasks(["Why is the sky blue?"], 9, 4)
    assert tasks[0] == "Look this up in the documents, then answer: Why is the sky blue?"
    assert any(c.isdigit() for c in tasks[1]) and ("remember" in tasks[2] or "tell you" in tasks[2])


def _answer(prompt, calls=(), ok=True, index=0):
    return RequestResult(index=index, client=0, domain=prompt.domain, phase=0, started_s=0.0, finished_s=1.0,
                         prompt=prompt, ok=ok, text=agent.canonical(None, [(n, a) for _, n, a in calls]),
                         completion_tokens=5, request_id=f"r{index}", tool_calls=tuple(calls))


def test_an_agent_task_is_a_required_call_then_the_tools_result_sent_back_under_auto():
    first = first_turn(Prompt(({"role": "user", "content": "What is 6 * 7?"},), "tools"), 32)
    assert first.tool_choice == "required" and first.max_tokens == agent.CALL_TOKENS and first.tools == agent.TOOLS_V1
    call = ("call_abc", "calculator", json.dumps({"expression": "6 * 7"}))
    second = next_turn(first, _answer(first, [call]), agent.Toolbox([]), 32)
    assert second.tool_choice == "auto" and second.max_tokens is None and second.domain == "tools"
    assert second.messages[-2]["tool_calls"][0]["id"] == "call_abc"
    assert second.messages[-1] == {"role": "tool", "tool_call_id": "call_abc", "content": "42"}
    _, request = parse_chat(second.chat_body("m", 32), 256, 32)  # the gateway takes the history
    chat = chat_prompt(None, request.messages, request.tools)  # as a replica renders it for SmolLM2's template
    assert "<tool_response>\n42\n</tool_response>" in chat.messages[-1]["content"]
    assert "# Tools" in chat.messages[0]["content"] and request.response_format is None
    _, request = parse_chat(first.chat_body("m", 32), 256, 32)
    fmt = json.loads(request.response_format)
    assert fmt["type"] == "tool_call" and fmt["max_calls"] == 1 and request.max_tokens == agent.CALL_TOKENS
    # the task ends after the second turn, a failed turn, or a first turn without calls
    assert next_turn(second, _answer(second, [call]), agent.Toolbox([]), 32) is None
    assert next_turn(first, _answer(first, [call], ok=False), agent.Toolbox([]), 32) is None
    assert next_turn(first, _answer(first), agent.Toolbox([]), 32) is None


def test_a_tool_turn_is_decoded_again_as_the_gateway_decodes_it_and_compared_in_canonical_form():
    first = first_turn(Prompt(({"role": "user", "content": "What is 6 * 7?"},), "tools"), 32)
    served = _answer(first, [("call_x", "calculator", '{"expression": "6 * 7"}')])
    seen = []

    def generate(request):  # test code: a replica's answer to the re-decode, the same call with other spacing
        seen.append(request)
        return SimpleNamespace(text='<tool_call>\n{"name": "calculator", "arguments": {"expression":"6 * 7"}}\n'
                                    '</tool_call>', spec=None)

    _, text = decode_again(SimpleNamespace(generate=generate), served, 32, "plain")
    assert text == served.text and not seen[0].capture and seen[0].request_id == "plain-r0"
    assert json.loads(seen[0].response_format)["type"] == "tool_call" and json.loads(seen[0].tools)["tools"]


def test_the_report_counts_valid_calls_per_tool_choice_and_an_invalid_required_call_fails_the_demo():
    first = first_turn(Prompt(({"role": "user", "content": "q"},), "tools2"), 32)
    good = ("c1", "evaluate", json.dumps({"formula": "1+1", "decimals": 1}))
    bad = ("c2", "evaluate", json.dumps({"formula": "1+1"}))  # decimals is required
    second = next_turn(first, _answer(first, [good]), agent.Toolbox([]), 32)
    results = [_answer(first, [good], index=0), _answer(first, [bad], index=1), _answer(first, [good, good], index=2),
               _answer(second, [], index=3), _answer(second, [good], index=4)]
    counts = tool_calls(results)
    assert {k: (v["turns"], v["with_calls"], v["valid"]) for k, v in counts.items()} == {
        "required": (3, 3, 1), "auto": (2, 1, 1)}
    assert len(counts["required"]["invalid_examples"]) == 2
    assert tool_calls([_answer(Prompt((), "code"))]) is None  # no agent turns: nothing to count
    s = summary([], results, [], [], [], {"replay_check": {"requests_differing": 0}})
    assert failed_checks(s) == ["2 agent turns under tool_choice required without exactly one valid call (the "
                                "call's grammar promises one)"]


def test_the_agent_scenario_changes_the_tool_set_halfway():
    cfg = DemoConfig.make(scenario="agent")
    assert cfg.scenario == ("tools", "tools2") and cfg.first_share == 0.5
    assert [(p.domain, p.end_s) for p in phase_plan(cfg.scenario, 100.0, cfg.first_share)] == [
        ("tools", 50.0), ("tools2", 100.0)]
    assert DemoConfig.make(scenario="agent", first_phase_share=0.3).first_share == 0.3
    assert DemoConfig.make(scenario="english,code").first_share == 0.2
    assert DemoConfig.make(scenario="english,agent").scenario == ("english", "agent")  # the agent-style prompts


def test_the_tpot_gain_carries_a_bootstrap_interval_that_holds_1_for_the_same_head_on_both_arms():
    import numpy as np

    from adaptive_eagle_cli.demo.report import tpot_gain_interval

    rng = np.random.default_rng(0)

    def req(i, arm, tpot):
        return RequestResult(index=i, client=0, domain="code", phase=1, started_s=0.0, finished_s=1.0,
                             prompt=Prompt((), "code"), ok=True, completion_tokens=20, arm=arm, tpot_s=tpot)

    same = [req(i, "holdback" if i % 5 == 0 else "served", float(rng.lognormal(np.log(0.04), 0.2))) for i in range(200)]
    lo, hi = tpot_gain_interval(same)
    assert lo < 1 < hi
    faster = [req(i, r.arm, r.tpot_s * (0.7 if r.arm == "served" else 1.0)) for i, r in enumerate(same)]
    lo, hi = tpot_gain_interval(faster)
    assert 1.2 < lo < 1 / 0.7 < hi
    assert tpot_gain_interval(same[:10]) is None  # 2 holdback requests: no interval
