"""policies.cli through the `adaptive-eagle` program: promotions (table, --json, --last, corrupt lines,
mistyped paths that create nothing), and rollback / pin / unpin, which move the registry and log a line."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle_cli import app
from policies.log import PromotionLog

GATE = {"gate": "canary", "metric": "accept_length", "quantile": 0.05, "tail_champion": 1.412,
        "tail_candidate": 1.465, "ci_low": 0.021, "ci_high": 0.088, "mean_champion": 1.9, "mean_candidate": 1.95,
        "n_champion": 410, "n_candidate": 402}


def invoke(*args):
    return CliRunner().invoke(app, list(map(str, args)), env={"COLUMNS": "250", "NO_COLOR": "1"})


@pytest.fixture
def reg(tmp_path, registry_template):
    shutil.copytree(registry_template, tmp_path / "registry")
    r = HeadRegistry(tmp_path / "registry")
    assert r.set_champion("v1", expect="none").ok and r.set_champion("v2", expect="v1").ok
    return r


def test_help_lists_the_policy_commands():
    res = invoke("--help")
    assert res.exit_code == 0
    for cmd in ("promotions", "rollback", "pin", "unpin", "heads"):
        assert cmd in res.output
    res = invoke("promotions", "--help")
    for opt in ("--log", "--registry", "--follow", "--json", "--last"):
        assert opt in res.output


def test_promotions_table_json_and_last(tmp_path):
    plog = PromotionLog(tmp_path / "promotions.jsonl")
    plog.record("canary_started", candidate="v2", champion="v1", reason="offline gate passed.", evidence=GATE)
    plog.record("promoted", candidate="v2", champion="v1", reason="every replica serves v2.", evidence=GATE)
    res = invoke("promotions", "--log", tmp_path / "promotions.jsonl")
    assert res.exit_code == 0, res.output
    for word in ("canary_started", "promoted", "v1→v2", "p5 1.412→1.465 [+0.021,+0.088]", "410/402",
                 "every replica serves v2."):
        assert word in res.output, word
    res = invoke("promotions", "--registry", tmp_path, "--json")  # <registry>/promotions.jsonl
    lines = [json.loads(line) for line in res.output.splitlines()]
    assert [d["event"] for d in lines] == ["canary_started", "promoted"] and lines[1]["evidence"] == GATE
    res = invoke("promotions", "--log", tmp_path / "promotions.jsonl", "--json", "--last", "1")
    assert [json.loads(line)["event"] for line in res.output.splitlines()] == ["promoted"]


def test_promotions_skips_corrupt_lines_with_a_warning(tmp_path):
    path = tmp_path / "promotions.jsonl"
    PromotionLog(path).record("considered", candidate="v2")
    with open(path, "a") as f:
        f.write('{"torn\n')
    res = invoke("promotions", "--log", path, "--json")
    assert res.exit_code == 0 and json.loads(res.stdout.splitlines()[0])["event"] == "considered"
    assert "skipped 1 corrupt line(s): 2" in res.stderr


@pytest.mark.parametrize("args", [["promotions", "--log", "{tmp}/nope/promotions.jsonl"],
                                  ["promotions", "--registry", "{tmp}/nope"],
                                  ["rollback", "--registry", "{tmp}/nope"],
                                  ["pin", "v1", "--registry", "{tmp}/nope"],
                                  ["unpin", "--registry", "{tmp}/nope"]])
def test_mistyped_paths_are_errors_that_create_nothing(tmp_path, args):
    res = invoke(*[a.format(tmp=tmp_path) for a in args])
    assert res.exit_code != 0 and "error:" in res.output
    assert "--log" in res.output or "--registry" in res.output
    assert not (tmp_path / "nope").exists()


def test_rollback_moves_the_pointer_blocks_and_logs(reg):
    res = invoke("rollback", "--registry", reg.root, "--reason", "p95 alarm")
    assert res.exit_code == 0, res.output
    assert "champion v2 -> v1" in res.output and reg.champion() == "v1" and "p95 alarm" in reg.blocked()["v2"].reason
    (event,) = PromotionLog(reg.root / "promotions.jsonl").read().events
    assert (event.event, event.by, event.candidate, event.champion) == ("rolled_back", "on-call", "v2", "v1")


def test_rollback_refusals_are_clear(reg):
    reg.pin("v2", "hold")
    res = invoke("rollback", "--registry", reg.root)
    assert res.exit_code != 0 and "pinned" in res.output and reg.champion() == "v2"
    assert not (reg.root / "promotions.jsonl").exists()


def test_pin_and_unpin_log_their_lines(reg, tmp_path):
    log = tmp_path / "elsewhere.jsonl"
    res = invoke("pin", "v3", "--registry", reg.root, "--reason", "known good", "--log", log)
    assert res.exit_code == 0, res.output
    assert reg.champion() == "v3" and reg.pinned().version == "v3"
    res = invoke("pin", "v1", "--registry", reg.root, "--log", log)
    assert res.exit_code != 0 and "already pinned" in res.output
    assert invoke("unpin", "--registry", reg.root, "--log", log).exit_code == 0 and reg.pinned() is None
    assert "nothing was pinned" in invoke("unpin", "--registry", reg.root, "--log", log).output
    events = PromotionLog(log).read().events
    assert [(e.event, e.candidate) for e in events] == [("pinned", "v3"), ("unpinned", "v3")]
    assert events[0].champion == "v2" and "known good" in events[0].reason


def test_pin_of_an_unknown_version_is_refused(reg):
    res = invoke("pin", "v9", "--registry", reg.root)
    assert res.exit_code != 0 and "v9" in res.output and reg.pinned() is None
