"""The `adaptive-eagle` program (adaptive_eagle_cli): help texts, clear refusals, export/import on a tiny head."""

import json

import pytest
import torch
from typer.testing import CliRunner

from adaptive_eagle.checkpoint import HeadMeta, save_head
from adaptive_eagle_cli import app
from adaptive_eagle.draft_head import DraftHeadConfig, Eagle3DraftHead, init_weights
from adaptive_eagle.targets import tiny_target


@pytest.fixture
def runner():
    return CliRunner()


def invoke(runner, *args):
    # wide terminal: rich must not wrap or ellipsize option names in help panels
    return runner.invoke(app, list(args), env={"COLUMNS": "250", "NO_COLOR": "1"})


def test_help_lists_the_commands(runner):
    res = invoke(runner, "--help")
    assert res.exit_code == 0, res.output
    for cmd in ("train-head", "eval-head", "export-head", "import-head", "demo"):
        assert cmd in res.output


def test_no_arguments_shows_help(runner):
    res = invoke(runner)
    assert res.exit_code != 0 and "Usage" in res.output and "train-head" in res.output


@pytest.mark.parametrize(
    "command, options",
    [
        ("train-head", ["--out", "--target", "--domains", "--data-jsonl", "--token-budget", "--minutes", "--lr",
                        "--max-len", "--batch-tokens", "--draft-vocab-size", "--num-experts", "--warm-start",
                        "--resume", "--init-head", "--eval-every"]),
        ("eval-head", ["--target", "--domains", "--convs", "--max-len", "--update-meta", "--json", "--by-position",
                       "--sessions", "--buckets"]),
        ("export-head", ["--format"]),
        ("import-head", ["--target"]),
        ("demo", ["--minutes", "--out", "--scenario", "--prompts", "--clients", "--quick"]),
    ],
)
def test_command_help(runner, command, options):
    res = invoke(runner, command, "--help")
    assert res.exit_code == 0, res.output
    assert f"{command} [OPTIONS]" in res.output
    for opt in options:
        assert opt in res.output, opt


def test_eval_head_on_a_missing_directory(runner, tmp_path):
    res = invoke(runner, "eval-head", "/nonexistent")
    assert res.exit_code != 0
    assert "head.json" in res.output and "/nonexistent" in res.output
    res = invoke(runner, "eval-head", str(tmp_path))  # exists, but is not a head version
    assert res.exit_code != 0 and "head.json" in res.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--by-position", "--buckets", "0,512,256"], "--buckets: buckets 0,512,256: at least two edges, the first 0"),
        (["--by-position", "--buckets", "512,1024"], "the first 0, strictly increasing"),
        (["--by-position", "--buckets", "0,1k"], "comma-separated integers"),
        (["--by-position", "--max-len", "8"], "--max-len 8: allowed 16..32768"),
        (["--max-len", "40000"], "--max-len 40000: allowed 16..32768"),
        (["--by-position", "--sessions", "0"], "--sessions"),
    ],
)
def test_eval_head_by_position_refuses_bad_buckets_and_lengths(runner, args, message):
    """Checked before any model or data is loaded (the head argument is the shipped head)."""
    res = invoke(runner, "eval-head", *args)
    assert res.exit_code != 0
    assert message in res.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["train-head", "--out", "OUT", "--max-len", "4"], "max_len"),
        (["train-head", "--out", "OUT", "--lr", "0"], "lr"),
        (["export-head", "/nonexistent", "OUT"], "config.json: missing"),
        (["export-head", "/nonexistent", "OUT", "--format", "onnx"], "unknown format"),
        (["import-head", "/nonexistent", "OUT"], "config.json: missing"),
    ],
)
def test_refusals_exit_non_zero_with_a_message(runner, tmp_path, args, message):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    res = invoke(runner, *args)
    assert res.exit_code != 0
    assert "error:" in res.output and message in res.output
    assert not (tmp_path / "out").exists()


def test_train_head_requires_out(runner):
    res = invoke(runner, "train-head")
    assert res.exit_code != 0 and "--out" in res.output


def test_export_then_import_a_tiny_head(runner, tmp_path):
    target = tiny_target(seed=0, num_layers=8)  # aux ids (2, 4, 5): distinct, as a saved head needs
    cfg = DraftHeadConfig.from_target(target.config, draft_vocab_size=48, aux_layer_ids=target.aux_layer_ids)
    torch.manual_seed(0)
    head = Eagle3DraftHead(cfg)
    init_weights(head)
    head.set_draft_vocab(torch.arange(48) * 2)
    save_head(head, tmp_path / "v1", HeadMeta.new("v1", target.name, target.fingerprint))

    res = invoke(runner, "export-head", str(tmp_path / "v1"), str(tmp_path / "spec"))
    assert res.exit_code == 0, res.output
    assert res.output.strip() == str(tmp_path / "spec")
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3" and spec["draft_vocab_size"] == 48

    res = invoke(runner, "export-head", str(tmp_path / "v1"), str(tmp_path / "spec"))  # immutable output
    assert res.exit_code != 0 and "exists" in res.output

    res = invoke(runner, "import-head", str(tmp_path / "spec"), str(tmp_path / "back"))
    assert res.exit_code == 0, res.output
    meta = json.loads(res.output)
    assert meta["training"] == {"recipe": "imported"} and meta["target_fingerprint"] == ""
    assert (tmp_path / "back" / "head.json").exists()


def test_generate_help_and_bad_input():
    from typer.testing import CliRunner

    from adaptive_eagle_cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["generate", "--help"])
    assert res.exit_code == 0 and "--temperature" in res.output and "--json" in res.output
    bad = runner.invoke(app, ["generate", "hi", "--max-tokens", "0", "--head", "none"])
    assert bad.exit_code != 0 and "invalid sampling" in bad.output


def test_each_package_mounts_its_own_commands():
    from adaptive_eagle.cli import app as core_app
    from trainer.cli import trainer_app

    assert {c.name for c in core_app.registered_commands} == {"generate", "target-info", "export-head", "import-head"}
    assert {c.name for c in trainer_app.registered_commands} == {"train-head", "eval-head", "calibrate-head", "data-stats",
                                                                 "regen-data"}
    top = invoke(CliRunner(), "--help").output
    for cmd in ("generate", "target-info", "data-stats", "store"):  # top level, not nested under a group
        assert cmd in top
    assert "trainer" not in top.split("Commands")[1]
