"""ops/alerts.yml on the backend's own metrics (serving/metrics.py BackendCollector), run by promtool on made-up
series: SGLangBackendDown pages for the replica whose backend is down, after a minute; SGLangRestartSwaps files a
ticket when a swap restarted SGLang (a cold start), and stays quiet for in-place swaps. promtool comes with
Debian's `prometheus` package; without it these tests skip, saying so."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

OPS = Path(__file__).resolve().parents[2] / "ops"


def promtool_path() -> str:
    """promtool, which `make test` installs (with Prometheus); a test that needs it fails without it."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: `make prometheus` installs it (Debian/Ubuntu: apt-get install "
                    "prometheus)", pytrace=False)
    return promtool


def promtool_test(tmp_path, name: str, input_series: list[dict], alert_tests: list[dict]) -> None:
    promtool = promtool_path()
    alerts = str(OPS / "alerts.yml")
    check = subprocess.run([promtool, "check", "rules", alerts], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    cases = {"rule_files": [alerts], "evaluation_interval": "15s",
             "tests": [{"interval": "15s", "input_series": input_series, "alert_rule_test": alert_tests}]}
    path = tmp_path / f"{name}_test.yml"
    path.write_text(yaml.safe_dump(cases))
    test = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert test.returncode == 0, test.stdout + test.stderr


def test_a_backend_down_pages_for_its_replica_after_a_minute(tmp_path):
    summary = ("replica sg-0: its SGLang server is down and every request to it fails (why: /admin/status "
               "replicas[].info.down)")
    promtool_test(tmp_path, "backend_down", [
        {"series": 'ae_backend_down{replica="sg-0"}', "values": "0 0 1x8"},  # down from 30 s
        {"series": 'ae_backend_down{replica="sg-1"}', "values": "0x10"},
    ], [
        {"eval_time": "1m", "alertname": "SGLangBackendDown", "exp_alerts": []},  # down 30 s: pending only
        {"eval_time": "2m", "alertname": "SGLangBackendDown", "exp_alerts": [{
            "exp_labels": {"severity": "page", "replica": "sg-0"},
            "exp_annotations": {"summary": summary, "runbook": "ops/RUNBOOK.md#sglangbackenddown"}}]},
    ])


def test_a_swap_by_restart_files_a_ticket_and_in_place_swaps_do_not(tmp_path):
    summary = "replica sg-1: 1 swap(s) by restarting SGLang in 30 minutes (each a cold start)"
    promtool_test(tmp_path, "restart_swaps", [
        # sg-0 swaps in place three times; sg-1 restarts SGLang once, at 1 minute
        {"series": 'ae_backend_swaps_total{how="session",replica="sg-0"}', "values": "0 1 1 2 2 3 3 3 3 3"},
        {"series": 'ae_backend_swaps_total{how="restart",replica="sg-0"}', "values": "0x10"},
        {"series": 'ae_backend_swaps_total{how="restart",replica="sg-1"}', "values": "0 0 0 0 1x6"},
    ], [
        {"eval_time": "45s", "alertname": "SGLangRestartSwaps", "exp_alerts": []},
        {"eval_time": "2m", "alertname": "SGLangRestartSwaps", "exp_alerts": [{
            "exp_labels": {"severity": "ticket", "replica": "sg-1"},
            "exp_annotations": {"summary": summary, "runbook": "ops/RUNBOOK.md#sglangrestartswaps"}}]},
    ])


def test_the_new_alerts_read_metrics_the_gateway_exports():
    from serving.metrics import GatewayMetrics

    rules = {r["alert"]: r for g in yaml.safe_load((OPS / "alerts.yml").read_text())["groups"] for r in g["rules"]}
    families = {f.name: f.type for f in GatewayMetrics().registry.collect()}
    assert families["ae_backend_down"] == "gauge" and families["ae_backend_swaps"] == "counter"
    assert "ae_backend_down" in rules["SGLangBackendDown"]["expr"]
    assert 'ae_backend_swaps_total{how="restart"}' in rules["SGLangRestartSwaps"]["expr"]
