"""Acceptance replay over a window of stored traffic, and `eval-head --root` refusing bad input."""

import time

import pytest
import torch
from typer.testing import CliRunner

from adaptive_eagle.checkpoint import HeadMeta
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle_cli import app
from feature_store.config import StoreConfig
from feature_store.writer import write_records
from tests.trainer.test_nearline import world  # noqa: F401  (module fixture)
from trainer.evaluate import parse_window, replay_store
from trainer.replay import TreeParams


def test_parse_window():
    assert parse_window("30m", now=10_000.0) == 10_000.0 - 1800
    assert parse_window("2d", now=200_000.0) == 200_000.0 - 172_800
    assert parse_window(None) is None
    with pytest.raises(ValueError, match="unit s, m, h or d"):
        parse_window("yesterday")


def test_replay_store_scores_heads_on_the_same_window_and_domains(tmp_path, world):  # noqa: F811
    target, head, records = world
    store = StoreConfig(backend="local", local_root=str(tmp_path / "store"), fsync=False)
    old = [r.__class__(**{**r.__dict__, "created_at": time.time() - 7200, "request_id": "old-" + r.request_id})
           for r in records[:4]]
    write_records(store, old + records)
    reg = HeadRegistry.create(tmp_path / "registry")
    reg.register(head, HeadMeta.new("v1", target.name, target.fingerprint), dtype=torch.float32)
    torch.manual_seed(3)
    other = head.__class__(head.cfg).float()
    other.load_state_dict(head.state_dict())
    for p in other.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    reg.register(other, HeadMeta.new("v2", target.name, target.fingerprint, parent="v1"), dtype=torch.float32)
    report, facts = replay_store(["v1", "v2"], store, registry=str(tmp_path / "registry"), window="1h",
                                 domains=["code"], newest=100, tree=TreeParams(3, 2, 6), target=target)
    assert facts["records"] == len(records) // 2  # the last hour, code only
    a, b = report.scores["v1"], report.scores["v2"]
    assert [r.request_id for r in a.records] == [r.request_id for r in b.records]
    assert {r.domain for r in a.records} == {"code"}
    _, few = replay_store(["v1"], store, registry=str(tmp_path / "registry"), newest=3, target=target)
    assert few["records"] == 3


def test_eval_head_on_a_mistyped_store_fails_and_creates_nothing(tmp_path):
    missing = tmp_path / "nope"
    res = CliRunner().invoke(app, ["eval-head", "v1", "--root", str(missing)])
    assert res.exit_code != 0 and "no feature store here" in res.output
    assert not missing.exists()


def test_eval_head_refuses_a_bad_store_config_file(tmp_path):
    bad = tmp_path / "store.json"
    bad.write_text('{"backend": "local"}')  # no local_root
    res = CliRunner().invoke(app, ["eval-head", "v1", "--store-config", str(bad)])
    assert res.exit_code == 2 and "bad store config" in res.output


def test_evaluation_reads_the_store_only_through_the_readers_scan():
    """trainer/evaluate.py opens no backend and decodes no payload itself: feature_store.reader.scan_records does."""
    import ast
    from pathlib import Path

    import trainer.evaluate

    tree = ast.parse(Path(trainer.evaluate.__file__).read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "feature_store.reader" in modules
    assert not modules & {"feature_store.backend", "feature_store.schema", "feature_store.cli"}
