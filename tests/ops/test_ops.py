"""ops/: the cluster config validates against Ray's own cluster schema, the production stack config
validates as a StackConfig (its secrets come from the environment), and every metric the alert rules
read is one the gateway exports; every alert has its runbook section."""

import re
from pathlib import Path

import pytest
import yaml

OPS = Path(__file__).resolve().parents[2] / "ops"


def test_cluster_yaml_validates_against_rays_schema():
    import json

    import jsonschema
    import ray

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    cluster = yaml.safe_load((OPS / "cluster.yaml").read_text())
    jsonschema.validate(cluster, schema)
    nodes = cluster["available_node_types"]
    assert nodes[cluster["head_node_type"]]["resources"]["ae_head"] == 1
    assert all(n["resources"].get("GPU", 0) >= 1 for name, n in nodes.items() if name != cluster["head_node_type"])
    text = (OPS / "cluster.yaml").read_text()
    assert not re.search(r"(password|token)\s*[:=]\s*['\"]?\w", text)  # no secret in the file
    node_sh = (OPS / "scripts" / "node.sh").read_text()  # Redis on the head: AUTH and TLS only
    assert "requirepass" in node_sh and "--port 0 --tls-port 6380" in node_sh


def test_prod_yaml_is_a_valid_stack_config_with_secrets_from_the_environment(monkeypatch):
    from loop.config import StackConfigError, load_stack_config

    with pytest.raises(StackConfigError, match="AE_"):  # nothing inline: without the variables it refuses
        for name in ("AE_ADMIN_TOKEN", "AE_API_KEY", "AE_REDIS_PASSWORD", "AE_REDIS_HOST"):
            monkeypatch.delenv(name, raising=False)
        load_stack_config(OPS / "prod.yaml")
    for name in ("AE_ADMIN_TOKEN", "AE_API_KEY", "AE_REDIS_PASSWORD"):
        monkeypatch.setenv(name, f"test-{name.lower()}")
    monkeypatch.setenv("AE_REDIS_HOST", "10.0.0.5")
    cfg = load_stack_config(OPS / "prod.yaml")
    assert cfg.store.redis_url == "rediss://10.0.0.5:6380/0"  # the address the certificate names
    assert cfg.store.backend == "redis" and cfg.store.tls and cfg.store.redis_url.startswith("rediss://")
    assert cfg.store.redis_password.get_secret_value() == "test-ae_redis_password"
    assert cfg.serving.backend == "sglang" and cfg.serving.admin_token is not None and cfg.ray.replica_num_gpus == 1
    assert cfg.trainer.resources == {"ae_head": 1} and cfg.nearline_config().device == "cuda"


def test_cluster_nodes_run_python_3_11_and_a_second_ray_up_replaces_the_stack():
    """The package needs Python >= 3.11 (the image has 3.10): every node builds a 3.11 venv, and every ray and
    adaptive-eagle command runs from it. Every command of the cluster file is one call of ops/scripts/node.sh
    (which tests/ops/test_node_script.py runs under Ray's own command wrapping), none matches processes by
    pattern (`pkill -f` / `pgrep -f` match Ray's wrapping shell: issue 33 item 1)."""
    import tomllib

    cluster = yaml.safe_load((OPS / "cluster.yaml").read_text())
    node_sh = "\n".join(line for line in (OPS / "scripts" / "node.sh").read_text().splitlines()
                        if not line.lstrip().startswith("#"))
    assert '"python$PYV" -m venv "$VENV"' in node_sh and "sys.version_info >= (3, 11)" in node_sh
    assert 'PYV="3.11"' in node_sh
    requires = tomllib.loads((OPS.parent / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11"
    keys = ("setup_commands", "head_setup_commands", "worker_setup_commands", "head_start_ray_commands",
            "worker_start_ray_commands")
    commands = [c for key in keys for c in cluster[key]]
    assert commands and all(c.startswith("bash ~/adaptive-eagle/ops/scripts/node.sh ") for c in commands)
    assert not re.search(r"\bp(kill|grep)\b[^\n]*-f", node_sh + "\n".join(commands))
    assert not re.search(r"^\s*ray stop|[^\w/]ray stop", node_sh, re.M)  # `ray stop` ends every node on a machine
    bare = re.compile(r"(?<![/\w'\"$-])(ray (start|stop)|adaptive-eagle up|python3? -m pip)")
    assert not [line for line in node_sh.splitlines() if bare.search(line.split("#")[0])]
    start = node_sh.split("cmd_head_start() {")[1].split("\n}\n")[0]
    assert start.index("stop_stack") < start.index("ray_start --head") < start.index("up --check") < start.index("launch ")


def test_the_local_cluster_runs_the_cloud_clusters_node_script_and_a_valid_stack(monkeypatch):
    """ops/local-cluster.yaml (bench/cluster.py runs it with `ray up`) makes the same node.sh calls as
    ops/cluster.yaml, per step, so the cloud file cannot drift from the one that runs here; its stack config is
    a valid StackConfig whose replicas need the workers' resource and whose trainer needs the head's; as prod, two
    replicas, one on each of two worker nodes."""
    import json

    import jsonschema
    import ray

    from loop.config import load_stack_config

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    local = yaml.safe_load((OPS / "local-cluster.yaml").read_text())
    jsonschema.validate(local, schema)
    cloud = yaml.safe_load((OPS / "cluster.yaml").read_text())
    assert local["provider"]["type"] == "local" and local["provider"]["head_ip"].startswith("127.0.0.")

    def steps(cluster: dict, key: str) -> list[str]:
        lines = cluster.get(key) or []
        assert all(c.startswith("bash ~/adaptive-eagle/ops/scripts/node.sh ") for c in lines), (key, lines)
        return [c.split()[2] for c in lines]

    for key in ("setup_commands", "head_setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
        assert steps(local, key) == steps(cloud, key), key
    assert steps(cloud, "worker_setup_commands") == ["setup"] and steps(local, "worker_setup_commands") == []
    (head_start,) = local["head_start_ray_commands"]
    (worker_start,) = local["worker_start_ray_commands"]
    assert "ae_head" in head_start and "ae_replica" in worker_start  # the local provider gets no resource override
    # shaped like prod: as many worker nodes as ops/prod.yaml has replicas, each with room for exactly one
    workers = local["provider"]["worker_ips"]
    prod_replicas = yaml.safe_load((OPS / "prod.yaml").read_text())["serving"]["replicas"]
    assert len(set(workers)) == len(workers) == prod_replicas == local["max_workers"]
    assert local["provider"]["head_ip"] not in workers and all(ip.startswith("127.0.0.") for ip in workers)
    assert """--resources='{"ae_replica":1}'""" in worker_start
    # one start line for every worker: a fixed dashboard-agent port would be bound twice on 127.0.0.1
    assert "--dashboard-agent-listen-port=0" in worker_start
    env = {"AE_ADMIN_TOKEN": "a", "AE_API_KEY": "b", "AE_REDIS_PASSWORD": "c", "AE_REDIS_HOST": "127.0.0.2"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = load_stack_config(OPS / "local.yaml")
    assert cfg.ray.address == "auto" and cfg.ray.replica_resources == {"ae_replica": 1}
    assert cfg.trainer.resources == {"ae_head": 1} and cfg.store.backend == "redis" and cfg.store.tls
    assert cfg.serving.host == local["provider"]["head_ip"]
    assert cfg.serving.replicas == len(workers) and cfg.ray.replica_resources == {"ae_replica": 1}


def exported_metrics() -> set[str]:
    """Every metric name the gateway's /metrics can show: its own, and the loop's (stack: trainer, policy)."""
    from loop.metrics import LoopCollector, LoopWatcher
    from serving.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    drift = {"code": {"ewma": 1.5, "records": 40, "flagged": True, "baseline": 1.8, "reference": 1.8}}
    watcher = LoopWatcher(trainer_status=lambda: {"state": "training", "drift": drift}, candidate_time=lambda: 0.0,
                          last_event=lambda: {"event": "promoted", "at": 0.0, "promoted_at": 0.0},
                          policy_running=lambda: True)
    watcher.poll()
    metrics.registry.register(LoopCollector(watcher))
    names = set()
    for family in metrics.registry.collect():
        kind = family.type
        suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}.get(kind, ("",))
        names.update(family.name + s for s in suffixes)
    return names


def test_alert_rules_read_metrics_the_gateway_exports_and_each_has_a_runbook_section():
    rules = [r for g in yaml.safe_load((OPS / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    assert len(rules) >= 8
    known = exported_metrics()
    runbook = (OPS / "RUNBOOK.md").read_text().lower()
    for rule in rules:
        used = set(re.findall(r"\bae_[a-z_]+", rule["expr"]))
        assert used <= known and (used or rule["expr"].startswith("up{")), (rule["alert"], used - known)
        anchor = rule["annotations"]["runbook"].split("#")[1]
        assert f"### {anchor}" in runbook, rule["alert"]  # the section on-call is sent to exists
        assert rule["labels"]["severity"] in ("page", "ticket")


def test_alert_rules_pass_promtool_and_replica_down_pages_for_the_replica_that_is_down(tmp_path):
    """promtool parses every rule, and ReplicaDown fires, with the replica's name, only after a minute down."""
    import subprocess

    from tests.ops.test_alerts import promtool_path

    promtool = promtool_path()
    alerts = str(OPS / "alerts.yml")
    check = subprocess.run([promtool, "check", "rules", alerts], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    summary = "replica actor-0 has not answered its status for a minute (actor dead or restarting)"
    cases = {"rule_files": [alerts], "evaluation_interval": "15s", "tests": [{
        "interval": "15s",
        "input_series": [{"series": 'ae_replica_up{replica="actor-0"}', "values": "1 1 0x8"},  # down from 30 s
                         {"series": 'ae_replica_up{replica="actor-1"}', "values": "1x10"}],
        "alert_rule_test": [
            {"eval_time": "1m", "alertname": "ReplicaDown", "exp_alerts": []},  # down 30 s: pending only
            {"eval_time": "2m", "alertname": "ReplicaDown", "exp_alerts": [{
                "exp_labels": {"severity": "page", "replica": "actor-0"},
                "exp_annotations": {"summary": summary, "runbook": "ops/RUNBOOK.md#replicadown"}}]}]}]}
    (tmp_path / "replica_down_test.yml").write_text(yaml.safe_dump(cases))
    test = subprocess.run([promtool, "test", "rules", str(tmp_path / "replica_down_test.yml")], capture_output=True,
                          text=True)
    assert test.returncode == 0, test.stdout + test.stderr
