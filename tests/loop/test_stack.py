"""The stack `adaptive-eagle up` runs, on the tiny target: its config (one YAML, unknown keys named,
env secrets), the load signal the trainer yields to, the candidate feed, and ONE run of the whole
stack on Ray (a ServerActor replica, the TrainerActor, the policy on the gateway's fleet) that
serves the openai client, captures into the store, canaries a new candidate inside the one replica,
and shuts down cleanly."""

import json
import time

import httpx
import openai
import pytest
import torch
from typer.testing import CliRunner

from adaptive_eagle.checkpoint import HeadMeta
from loop.candidates import CandidateFeed, replay_samples
from loop.load_signal import LoadPublisher, LoadSignal
from loop.stack import LocalStack
from loop.config import StackConfigError, defaults_yaml, load_stack_config, parse_stack_config
from tests.serving.conftest import make_target, tiny_head

MODEL = "tiny-eagle"
PROMPTS = ["w5 w9 w12 w7 w30", "w40 w41 w8", "w11 w22 w33 w44 w55 w6", "w17 w4 w60"]


def test_the_stack_config_is_one_yaml_whose_errors_name_the_key(tmp_path, monkeypatch):
    cfg = parse_stack_config({"state_dir": str(tmp_path), "trainer": {"lr": 1e-3}, "policy": {"min_samples": 150}})
    assert cfg.store_config.local_root == str(tmp_path / "store") and cfg.nearline_config().lr == 1e-3
    assert cfg.nearline_config().registry == str(tmp_path / "registry") and cfg.policy.gates().min_samples == 150
    assert cfg.promotion_log == tmp_path / "registry" / "promotions.jsonl"
    assert cfg.nearline_config().min_candidate_heldout == 150  # no candidate before the offline gate can judge it
    own = parse_stack_config({"state_dir": str(tmp_path), "trainer": {"min_candidate_heldout": 7}})
    assert own.nearline_config().min_candidate_heldout == 7
    for bad, named in [({"servng": {}}, "servng: unknown key"), ({"trainer": {"lrr": 1}}, "trainer.lrr: unknown key"),
                       ({"serving": {"port": 70000}}, "serving.port"), ({"trainer": {"work_dir": "x"}}, "trainer.work_dir"),
                       ({"policy": {"canary_fraction": 0.9}}, "policy.canary_fraction"),
                       ({"serving": {"replicas": 2}}, "serving.replicas"),
                       ({"serving": {"registry_path": "x"}}, "serving.registry_path"),
                       ({"policy": {"min_samples": 50}}, "policy: min_domain_samples")]:
        with pytest.raises(StackConfigError, match=named.replace(".", r"\.")):
            parse_stack_config(bad)
    monkeypatch.setenv("AE_TEST_REDIS_PASSWORD", "s3cret")
    path = tmp_path / "stack.yaml"
    path.write_text("store:\n  backend: redis\n  redis_password: ${AE_TEST_REDIS_PASSWORD}\n")
    assert load_stack_config(path).store.redis_password.get_secret_value() == "s3cret"
    path.write_text("store:\n  redis_password: ${AE_TEST_UNSET_VARIABLE}\n")
    with pytest.raises(StackConfigError, match="AE_TEST_UNSET_VARIABLE"):
        load_stack_config(path)
    with pytest.raises(StackConfigError, match="no such config file"):
        load_stack_config(tmp_path / "mistyped.yaml")
    import yaml

    defaults = yaml.safe_load(defaults_yaml())
    assert set(defaults) == {"state_dir", "ray", "serving", "store", "trainer", "policy", "registry"}
    from trainer.config import NearlineConfig

    # the printed defaults are the trainer's and the policy's own
    assert defaults["trainer"]["lr"] == NearlineConfig.model_fields["lr"].default
    assert "canary_fraction" in defaults["policy"]
    assert parse_stack_config(defaults).serving.port == 8000  # the printed defaults load back


def test_up_prints_its_defaults_and_refuses_a_mistyped_config(tmp_path):
    from adaptive_eagle_cli import app

    runner = CliRunner()
    out = runner.invoke(app, ["up", "--print-config"])
    assert out.exit_code == 0 and "serving:" in out.output and "yield_queue_depth" in out.output
    bad = runner.invoke(app, ["up", "--config", str(tmp_path / "nope.yaml")])
    assert bad.exit_code == 2 and "no such config file" in bad.output


class FakeRouter:
    waiting, busy = 0, 0


def test_the_trainer_yields_while_requests_wait(tmp_path):
    signal = LoadSignal(str(tmp_path / "load.json"), queue_depth=2, stale_s=2.0)
    router = FakeRouter()
    publisher = LoadPublisher(signal, router)
    assert signal() is False  # no gateway yet: never held back
    publisher.step()
    assert signal() is False
    router.waiting = 2
    publisher.step()
    assert signal() is True and signal.read()["waiting"] == 2
    router.waiting, router.busy = 0, 1
    publisher.step()
    assert signal() is False and LoadSignal(signal.path, 2, when_busy=True)() is True
    data = json.loads((tmp_path / "load.json").read_text())
    (tmp_path / "load.json").write_text(json.dumps({**data, "waiting": 9, "at": time.time() - 10}))
    assert signal() is False  # a stale signal (the gateway stopped) never holds the trainer
    assert LoadSignal(signal.path, queue_depth=0)() is False


def samples(n, accept, domain="chat"):
    return [[f"r{i}", domain, accept] for i in range(n)]


def register_candidate(registry, target, version, cand=2.0, champ=1.2, champion="v1", n=40):
    metrics = {"replay": {"champion_version": champion,
                          "samples": {"candidate": samples(n, cand), "champion": samples(n, champ)}}}
    registry.register(tiny_head(target, 21), HeadMeta.new(version, target.name, target.fingerprint, metrics=metrics),
                      dtype=torch.float32)


def test_replay_samples_become_request_samples(stack, tmp_path):
    from adaptive_eagle.registry import HeadRegistry

    reg = HeadRegistry.create(tmp_path / "reg")
    register_candidate(reg, stack.target, "c1", n=3)
    champ, cand = replay_samples(reg.version("c1").metrics, "c1")
    assert [(s.request_id, s.domain, s.accept_length, s.head_version) for s in cand] == [
        ("r0", "chat", 2.0, "c1"), ("r1", "chat", 2.0, "c1"), ("r2", "chat", 2.0, "c1")]
    assert {s.head_version for s in champ} == {"v1"} and replay_samples({}, "x") is None
    feed = CandidateFeed(reg)
    assert feed.scan() is None  # versions present at start are never considered
    register_candidate(reg, stack.target, "c2", n=3)
    register_candidate(reg, stack.target, "c3", n=3)
    assert feed.scan() == "c3"  # the newest replaces an older waiting one


def test_replay_rows_carry_a_context_position_when_written_with_one():
    """Rows of [request_id, domain, accept_length, context position]; rows written before it have 3 elements and
    are not sliced by context (the policy's context guard leaves them out)."""
    metrics = {"replay": {"champion_version": "v1", "samples": {
        "candidate": [["r0", "chat", 2.0, 4100], ["r1", None, 1.5]], "champion": [["r0", "chat", 1.2, 4100]]}}}
    champ, cand = replay_samples(metrics, "c1")
    assert [(s.request_id, s.context) for s in cand] == [("r0", 4100), ("r1", None)]
    assert champ[0].context == 4100
    bad = {"replay": {"samples": {"candidate": [["r0", "chat", 2.0, 1, 2]]}}}
    with pytest.raises(ValueError, match="context_position"):
        replay_samples(bad, "c1")


def test_a_malformed_replay_block_is_refused_counted_and_never_considered(stack, tmp_path):
    """A head.json whose metrics.replay does not parse (here an accept length below 1) is refused with the field
    named, counted with the refused evidence files, and the scan goes on to the versions after it."""
    from adaptive_eagle.registry import HeadRegistry

    reg = HeadRegistry.create(tmp_path / "reg")
    feed = CandidateFeed(reg)
    register_candidate(reg, stack.target, "c1", cand=0.5, n=3)
    register_candidate(reg, stack.target, "c2", n=3)
    assert feed.scan() == "c2"
    assert set(feed.refused) == {"c1"} and "metrics.replay.samples.candidate.0.accept_length" in feed.refused["c1"]
    assert feed.counts()["refused"] == 1 and feed.scan() == "c2"  # refused once, not looked at again


def test_held_out_replay_hands_the_policy_each_record_s_context_position():
    """Two heads replayed on the same captured records: every sample of a record has the same context position
    (prompt + half the generated tokens), the rows of head.json carry it, and the feed reads it back."""
    from adaptive_eagle.positions import context_position
    from tests.adaptive_eagle.test_engine import tiny_setup
    from tests.trainer.test_replay import SERVE, captured_records
    from trainer.replay import TreeParams, replay_heads, replay_metrics

    target, head = tiny_setup(seed=3)
    _, other = tiny_setup(seed=4)
    torch.manual_seed(0)
    records = captured_records(target, head, [torch.randint(0, 32, (n,)).tolist() for n in (5, 9, 14)], max_tokens=12)
    tree = TreeParams(**{k: SERVE[k] for k in ("depth", "topk", "num_draft_tokens")})
    report = replay_heads({"champion": head, "candidate": other}, records, target, tree)
    metrics = {"replay": replay_metrics(report.scores["candidate"], report.scores["champion"], "v1", tree, {})}
    champ, cand = replay_samples(metrics, "c1")
    want = {r.request_id: context_position(r.loss_mask.index(1), sum(r.loss_mask)) for r in records}
    assert {s.request_id: s.context for s in champ} == {s.request_id: s.context for s in cand} == want
    assert all(len(row) == 4 for row in metrics["replay"]["samples"]["candidate"])


def stack_config(tmp_path, seed_head):
    return parse_stack_config({
        "state_dir": str(tmp_path / "state"),
        "ray": {"replica_num_cpus": 0},
        "registry": {"seed_head": seed_head},
        "serving": {"model_name": MODEL, "port": 0, "max_prompt_tokens": 40, "max_tokens_limit": 64,
                    "default_max_tokens": 16, "capture": {"fraction": 1.0, "seed": 0},
                    "engine": {"depth": 4, "topk": 3, "num_draft_tokens": 10, "cost_aware": False,
                               "prompt_lookup": False, "suffix_drafting": False, "calibration_dir": ""}},
        "store": {"fsync": False},
        "trainer": {"num_cpus": 0, "checkpoint_every_s": 2, "poll_ms": 50, "device": "cpu"},
        "policy": {"tick_s": 0.5, "candidate_poll_s": 0.3, "min_samples": 20, "min_domain_samples": 5,
                   "canary_fraction": 0.5, "canary_min_requests": 1000, "bootstrap_resamples": 200},
    })


def wait_for(predicate, timeout_s=180.0, every_s=0.2):
    """Poll until `predicate` holds; the deadline only stops a hung test (the verdict never depends on speed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(every_s)
    return predicate()


def test_the_stack_serves_captures_canaries_a_candidate_and_stops_cleanly(ray_session, stack, tmp_path):
    ray = ray_session
    cfg = stack_config(tmp_path, str(stack.registry.get("v1")))
    local = LocalStack(cfg, target_builder=make_target)
    try:
        info = local.start()
        assert info.champion == "v1" and info.trainer and info.policy and info.replicas == ["replica-0"]
        assert "registry" in info.registry and "local Arrow segments" in info.store
        client = openai.OpenAI(base_url=info.endpoint, api_key="x", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": PROMPTS[0]}]
        want = stack.plain_text(msgs, 12).text
        resp = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=12)
        assert resp.choices[0].message.content == want and resp.adaptive_eagle["head_version"] == "v1"
        for p in PROMPTS[1:]:
            assert client.completions.create(model=MODEL, prompt=p, max_tokens=8).adaptive_eagle["captured"] == "hidden"
        # no admin_token configured: the stack writes one into its state dir, and it opens /admin/*
        token = (cfg.state_path / "admin_token").read_text().strip()
        base = info.endpoint.removesuffix("/v1")
        admin = httpx.get(base + "/admin/status", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert admin.status_code == 200 and admin.json()["champion"] == "v1", admin.text
        assert httpx.get(base + "/admin/status", headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 403
        seen = wait_for(lambda: ray.get(local.trainer.status.remote())["records_seen"] >= 4)
        assert seen, ray.get(local.trainer.status.remote())  # the trainer actor reads what the replica captured
        assert local.signal.read() is not None  # the gateway publishes its load for the trainer

        register_candidate(local.registry, stack.target, "c1")  # as the trainer would, with replay evidence
        assert wait_for(lambda: local.feed.considered)[0][0] == "c1"
        assert wait_for(lambda: local.app.state.gateway.router.canary is not None)
        heads = {client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                temperature=0, max_tokens=4).adaptive_eagle["head_version"]
                 for p in PROMPTS * 3}
        assert heads == {"v1", "c1"}  # one replica, the candidate decodes its share of requests
        log = [json.loads(line) for line in open(info.promotion_log)]
        assert [e["event"] for e in log if e.get("candidate") == "c1"][:2] == ["considered", "canary_started"]
        # the loop's own metrics: the trainer steps or waits, the policy runs, its last decision is on /metrics
        def decided():
            text = httpx.get(base + "/metrics", timeout=30).text
            return text if 'ae_policy_last_decision{action="promote",candidate="c1",event="canary_started"} 1.0' \
                in text else None

        metrics = wait_for(decided)
        assert metrics and "ae_trainer_healthy 1.0" in metrics and "ae_policy_running 1.0" in metrics, metrics
        assert "ae_trainer_last_step_age_seconds" in metrics and 'ae_capture_store_state{replica="replica-0",state="ok"}' \
            in metrics
    finally:
        local.stop()
    assert local.trainer is None and local.replicas == [] and not (cfg.state_path / "load.json").exists()
    assert all(not t.is_alive() for t in local._threads)
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=info.endpoint, api_key="x", max_retries=0, timeout=5).models.list()
