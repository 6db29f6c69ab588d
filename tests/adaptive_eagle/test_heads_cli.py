"""`adaptive-eagle heads ...`: the registry from the command line."""

import json

import torch
from typer.testing import CliRunner

from adaptive_eagle.checkpoint import save_head
from adaptive_eagle_cli import app
from tests.adaptive_eagle.test_registry import make_head, meta
from adaptive_eagle.targets import tiny_target


def run(*args):
    return CliRunner().invoke(app, ["heads", *args], env={"COLUMNS": "200", "NO_COLOR": "1"})


def test_heads_commands_end_to_end(tmp_path):
    target = tiny_target(num_layers=8)
    root = tmp_path / "reg"
    missing = run("list", "--registry", str(root))
    assert missing.exit_code != 0 and "does not exist" in missing.output and not root.exists()  # read-only: no state
    assert run("init", "--registry", str(root)).exit_code == 0
    for name, parent in (("v1", None), ("v2", "v1")):
        save_head(make_head(target, seed=len(name + str(parent))), tmp_path / name, meta(target, name, parent),
                  dtype=torch.float32)
        res = run("add", str(tmp_path / name), "--registry", str(root))
        assert res.exit_code == 0 and name in res.output, res.output
    again = run("add", str(tmp_path / "v1"), "--registry", str(root))
    assert again.exit_code != 0 and "immutable" in again.output
    assert json.loads(run("show", "v2", "--registry", str(root)).output)["lineage"][:2] == ["v2", "v1"]
    assert run("champion", "--registry", str(root), "--set", "v1").exit_code != 0  # --expect is required
    moved = run("champion", "--registry", str(root), "--set", "v1", "--expect", "none", "--reason", "test")
    assert moved.exit_code == 0, moved.output
    stale = run("champion", "--registry", str(root), "--set", "v2", "--expect", "none")
    assert stale.exit_code != 0
    assert run("block", "v2", "--registry", str(root), "--reason", "collapsed").exit_code == 0
    refused = run("champion", "--registry", str(root), "--set", "v2", "--expect", "v1")
    assert refused.exit_code != 0 and "blocked" in refused.output
    listed = json.loads(run("list", "--registry", str(root), "--json").output)
    assert listed["champion"] == "v1" and listed["blocked"] == ["v2"]
    assert [v["version"] for v in listed["versions"]] == ["v1", "v2"]
    table = run("list", "--registry", str(root)).output
    assert "*" in table and "B" in table
    assert run("pin", "v1", "--registry", str(root)).exit_code == 0
    assert "unpinned v1" in run("unpin", "--registry", str(root)).output
