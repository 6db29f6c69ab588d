"""`adaptive-eagle store stats|tail|export` on a local store."""

import json

from typer.testing import CliRunner

from adaptive_eagle_cli import app
from feature_store.writer import StoreWriter
from tests.feature_store.conftest import make_record


def invoke(*args):
    return CliRunner().invoke(app, ["store", *args], env={"COLUMNS": "250", "NO_COLOR": "1"})


def test_stats_tail_export(local_cfg, tmp_path):
    cfg = local_cfg()
    w = StoreWriter(cfg)
    for i in range(4):
        w.put(make_record(i))
    w.put(make_record(9, capture_consent=False))
    w.close()
    root = cfg.local_root
    res = invoke("stats", "--root", root, "--json")
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)
    assert (s["records"], s["lag"], s["written"], s["opted_out"]) == (4, 4, 4, 1)
    res = invoke("stats", "--root", root)
    assert res.exit_code == 0 and "opted out" in res.output
    res = invoke("tail", "--root", root, "-n", "2")
    assert res.exit_code == 0 and "req-3" in res.output and "req-2" in res.output and "req-1" not in res.output
    res = invoke("export", str(tmp_path / "o.jsonl"), "--root", root, "--domain", "code")
    assert res.exit_code == 0 and "wrote 2 records" in res.output, res.output
    res = invoke("export", str(tmp_path / "o.parquet"), "--root", root, "--hidden", "float32",
                 "--since", "2023-11-14T22:13:21")
    assert res.exit_code == 0 and "wrote 3 records" in res.output, res.output


def test_clear_refusals():
    assert invoke("stats").exit_code == 2
    res = invoke("stats", "--redis-url", "redis://127.0.0.1:1/0")
    assert res.exit_code == 1 and "unavailable" in res.output


def test_read_only_commands_refuse_a_mistyped_store_and_create_nothing(tmp_path):
    missing = tmp_path / "no-such-store"
    for args in (("stats", "--root", str(missing)), ("tail", "--root", str(missing)),
                 ("export", str(tmp_path / "o.jsonl"), "--root", str(missing))):
        res = invoke(*args)
        assert res.exit_code == 1 and "no feature store here" in res.output, args
    assert not missing.exists() and not (tmp_path / "o.jsonl").exists()
