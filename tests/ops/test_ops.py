"""ops/: the cluster config validates against Ray's own cluster schema, the production stack config
validates as a StackConfig (its secrets come from the environment), and every metric the alert rules
read is one the gateway exports; every alert has its runbook section."""

import re
from pathlib import Path

import pytest
import yaml

OPS = Path(__file__).resolve().parents[2] / "ops"


def test_cluster_yaml_validates_against_rays_schema():
    jsonschema = pytest.importorskip("jsonschema")
    ray = pytest.importorskip("ray")
    import json

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    cluster = yaml.safe_load((OPS / "cluster.yaml").read_text())
    jsonschema.validate(cluster, schema)
    nodes = cluster["available_node_types"]
    assert nodes[cluster["head_node_type"]]["resources"]["ae_head"] == 1
    assert all(n["resources"].get("GPU", 0) >= 1 for name, n in nodes.items() if name != cluster["head_node_type"])
    text = (OPS / "cluster.yaml").read_text()
    assert "requirepass" in text and "tls-port" in text and not re.search(r"(password|token)\s*[:=]\s*['\"]?\w", text)


def test_prod_yaml_is_a_valid_stack_config_with_secrets_from_the_environment(monkeypatch):
    from serving.stack_config import StackConfigError, load_stack_config

    with pytest.raises(StackConfigError, match="AE_"):  # nothing inline: without the variables it refuses
        for name in ("AE_ADMIN_TOKEN", "AE_API_KEY", "AE_REDIS_PASSWORD"):
            monkeypatch.delenv(name, raising=False)
        load_stack_config(OPS / "prod.yaml")
    for name in ("AE_ADMIN_TOKEN", "AE_API_KEY", "AE_REDIS_PASSWORD"):
        monkeypatch.setenv(name, f"test-{name.lower()}")
    cfg = load_stack_config(OPS / "prod.yaml")
    assert cfg.store.backend == "redis" and cfg.store.tls and cfg.store.redis_url.startswith("rediss://")
    assert cfg.store.redis_password.get_secret_value() == "test-ae_redis_password"
    assert cfg.serving.backend == "sglang" and cfg.serving.admin_token is not None and cfg.ray.replica_num_gpus == 1
    assert cfg.trainer.resources == {"ae_head": 1} and cfg.nearline_config().device == "cuda"


def exported_metrics() -> set[str]:
    from serving.metrics import GatewayMetrics

    names = set()
    for family in GatewayMetrics().registry.collect():
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
