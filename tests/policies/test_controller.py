"""policies.controller: the promotion state machine against a real head registry (tiny heads in tmp_path)
and a LocalFleet of recording replicas: promote and watch, offline and canary rejections, a partial swap
rolled back, a collapse rolled back and blocked, pins, blocks, the cold start, on-call rollback, and the
story the log tells. The controller itself never imports torch (checked in a fresh interpreter)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest

from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle.versions import PLAIN
from policies.controller import PolicyController, rollback_champion
from policies.canary import Canary
from policies.gates import CONTINUE, HOLD, PROMOTE, REJECT, ROLLBACK
from policies.log import PromotionLog
from tests.policies.fleets import LocalFleet
from tests.policies.helpers import replay, small_config
from tests.policies.replicas import FakeClock, RecordingReplica, Traffic

# the state machine's tests run the one-look evidence canary (sequential=False); the health canary and the
# sequential evidence canary have their own tests at the end
CFG = small_config(min_samples=200, canary_min_requests=100, rollback_window=100, collapse_min_requests=20,
                   canary_fraction=0.5, bootstrap_resamples=500, sequential=False)


@dataclass
class World:
    ctrl: PolicyController
    reg: HeadRegistry
    fleet: LocalFleet
    replicas: list
    plog: PromotionLog
    traffic: Traffic
    clock: FakeClock

    def events(self) -> list[str]:
        return [e.event for e in self.plog.read().events]

    def run_canary(self, n: int = 400):
        self.traffic.serve(n)
        return self.ctrl.tick()


def make_world(tmp_path, registry_template, *, champion="v1", refuse=None, quality=None, speed=None,
               replicas=3) -> World:
    root = tmp_path / "registry"
    shutil.copytree(registry_template, root)
    reg = HeadRegistry(root)
    if champion != PLAIN:
        assert reg.set_champion(champion, expect=PLAIN).ok
    reps = [RecordingReplica(None if champion == PLAIN else champion, refuse=set((refuse or {}).get(i, ())))
            for i in range(replicas)]
    fleet, clock = LocalFleet(reps), FakeClock()
    plog = PromotionLog(tmp_path / "promotions.jsonl")
    traffic = Traffic(fleet, clock, quality=quality or {"v1": 0.0, "v2": 0.3, "v3": -0.3}, speed=speed or {})
    return World(PolicyController(reg, fleet, plog, CFG, clock=clock), reg, fleet, reps, plog, traffic, clock)


@pytest.fixture
def world(tmp_path, registry_template):
    return make_world(tmp_path, registry_template)


def promote_v2(w: World) -> None:
    assert w.ctrl.consider("v2", *replay(0.0, 0.3)).action == PROMOTE
    assert w.run_canary().action == PROMOTE and w.ctrl.state == "watching"


# ---- the happy path ------------------------------------------------------------------------------
def test_a_better_head_goes_offline_gate_canary_promote_watch(world):
    w = world
    assert w.ctrl.consider("v2", *replay(0.0, 0.3)).action == PROMOTE
    assert w.ctrl.state == "canary" and w.fleet.canary == Canary("v2", CFG.canary_fraction)
    w.traffic.serve(60)
    assert w.ctrl.tick().action == CONTINUE and w.ctrl.state == "canary"
    assert w.run_canary().action == PROMOTE
    assert w.fleet.serving_versions() == ["v2"] * 3 and [r.swaps for r in w.replicas] == [["v2"]] * 3
    assert w.reg.champion() == "v2" and w.reg.champion_pointer().previous == "v1"
    assert w.ctrl.state == "watching" and w.fleet.canary is None
    w.traffic.serve(CFG.rollback_window // 2)
    assert w.ctrl.tick().action == CONTINUE
    w.traffic.serve(CFG.rollback_window)
    assert w.ctrl.tick().action == HOLD and w.ctrl.state == "idle"
    assert w.events() == ["considered", "canary_started", "canary_ended", "promoted", "watch_ended"]
    promoted = w.plog.read().events[3]
    assert (promoted.candidate, promoted.champion) == ("v2", "v1")
    assert promoted.evidence["gate"] == "canary" and promoted.evidence["ci_low"] > 0
    assert w.ctrl.tick() is None  # idle, fleet in sync


def test_the_pointer_moves_only_after_every_replica_confirmed(world):
    w = world
    seen = []
    for r in w.replicas:
        original = r.swap_head
        r.swap_head = lambda v, original=original: (seen.append(w.reg.champion()), original(v))[1]
    promote_v2(w)
    assert seen == ["v1"] * 3 and w.reg.champion() == "v2"


# ---- rejections ----------------------------------------------------------------------------------
def test_a_worse_head_is_rejected_offline_and_nothing_else_happens(world):
    w = world
    d = w.ctrl.consider("v3", *replay(0.0, -0.3, candidate="v3"))
    assert d.action == REJECT and w.ctrl.state == "idle" and w.fleet.canary is None
    assert all(r.swaps == [] for r in w.replicas) and w.reg.champion() == "v1" and "v3" not in w.reg.blocked()
    assert w.events() == ["considered", "rejected"]
    assert "does not improve" in w.plog.read().events[-1].reason


def test_too_little_replay_is_not_a_promotion(world):
    d = world.ctrl.consider("v2", *replay(0.0, 0.3, n=50))
    assert d.action == CONTINUE and world.ctrl.state == "idle"
    assert "more data" in world.plog.read().events[-1].reason


def test_a_canary_that_fails_live_ends_without_a_swap(tmp_path, registry_template):
    w = make_world(tmp_path, registry_template, quality={"v1": 0.0, "v2": -0.3})
    assert w.ctrl.consider("v2", *replay(0.0, 0.3)).action == PROMOTE  # replay looked good
    assert w.run_canary().action == REJECT
    assert w.fleet.canary is None and all(r.swaps == [] for r in w.replicas) and w.reg.champion() == "v1"
    assert w.events() == ["considered", "canary_started", "canary_ended", "rejected"]


def test_a_partial_swap_is_swapped_back(tmp_path, registry_template):
    w = make_world(tmp_path, registry_template, refuse={2: {"v2"}})
    assert w.ctrl.consider("v2", *replay(0.0, 0.3)).action == PROMOTE
    d = w.run_canary()
    assert d.action == REJECT and "replica 2" in d.reason and "failed validation" in d.reason
    assert w.fleet.serving_versions() == ["v1"] * 3 and w.reg.champion() == "v1" and w.ctrl.state == "idle"
    assert [r.swaps for r in w.replicas[:2]] == [["v2", "v1"]] * 2
    assert w.events()[-1] == "rejected" and "fleet back on v1" in w.plog.read().events[-1].reason


def test_a_registry_refusal_at_promotion_swaps_the_fleet_back(world):
    w = world
    assert w.ctrl.consider("v2", *replay(0.0, 0.3)).action == PROMOTE

    class Refusing:  # the real registry, except that the compare-and-set loses a race
        def __getattr__(self, name):
            return getattr(w.reg, name)

        def __contains__(self, v):
            return v in w.reg

        def set_champion(self, version, *, expect, reason=""):
            return type("Change", (), {"ok": False, "message": "stale expect: the champion is 'v3'"})()

    w.ctrl.registry = Refusing()
    d = w.run_canary()
    assert d.action == REJECT and "registry refused" in d.reason and "stale expect" in d.reason
    assert w.fleet.serving_versions() == ["v1"] * 3 and w.reg.champion() == "v1"


def test_a_fleet_that_refuses_the_canary_rejects_the_candidate(world):
    w = world

    def refuse(version, fraction):
        if version is not None:
            raise ValueError("a canary needs at least 2 replicas")

    w.fleet.set_canary = refuse
    d = w.ctrl.consider("v2", *replay(0.0, 0.3))
    assert d.action == REJECT and "could not start" in d.reason and "2 replicas" in d.reason
    assert w.ctrl.state == "idle" and w.events() == ["considered", "rejected"]


def test_a_head_the_fleet_can_never_serve_is_rejected_before_any_gate(world):
    w = world
    w.fleet.unservable["v2"] = "a MoE-routed head (2 experts)"
    d = w.ctrl.consider("v2", *replay(0.0, 0.3), sequential=True)
    assert d.action == REJECT and d.reason == "v2 cannot serve on this fleet: a MoE-routed head (2 experts)."
    assert w.ctrl.state == "idle" and w.events() == ["considered"] and w.plog.read().events[0].action == REJECT
    assert all(r.swaps == [] for r in w.replicas) and w.fleet.canary is None


# ---- rollback ------------------------------------------------------------------------------------
def test_a_collapse_after_promotion_rolls_back_and_blocks(world):
    w = world
    promote_v2(w)
    w.traffic.collapsed = {"v2"}
    w.traffic.serve(CFG.collapse_min_requests + 5)
    d = w.ctrl.tick()
    assert d.action == ROLLBACK and "collapse" in d.reason
    assert w.fleet.serving_versions() == ["v1"] * 3 and w.reg.champion() == "v1" and w.ctrl.state == "idle"
    assert "collapse" in w.reg.blocked()["v2"].reason
    assert w.events() == ["considered", "canary_started", "canary_ended", "promoted", "rolled_back"]
    # a blocked version is never considered again
    assert w.ctrl.consider("v2", *replay(0.0, 0.5)).action == REJECT
    assert "blocked" in w.plog.read().events[-1].reason and w.events()[-1] == "considered"


def test_a_rollback_the_registry_refuses_still_gets_the_fleet_off_the_bad_head(world):
    w = world
    promote_v2(w)
    w.reg.block("v1", "bad calibration")  # the previous champion cannot become champion again
    w.traffic.collapsed = {"v2"}
    w.traffic.serve(CFG.rollback_window)
    d = w.ctrl.tick()
    assert d.action == ROLLBACK and "registry refused" in d.reason and "heads champion --set" in d.reason
    assert w.fleet.serving_versions() == ["v1"] * 3 and w.reg.champion() == "v2" and "v2" in w.reg.blocked()
    assert w.ctrl.tick().action == HOLD and w.fleet.serving_versions() == ["v1"] * 3  # not swapped back onto v2
    assert w.events()[-1] == "rolled_back"


def test_on_call_rollback_through_the_controller(world):
    w = world
    promote_v2(w)
    d = w.ctrl.rollback("latency alarm")
    assert d.action == ROLLBACK and w.fleet.serving_versions() == ["v1"] * 3 and w.reg.champion() == "v1"
    last = w.plog.read().events[-1]
    assert (last.event, last.by, last.candidate, last.champion) == ("rolled_back", "on-call", "v2", "v1")
    assert "latency alarm" in last.reason and "latency alarm" in w.reg.blocked()["v2"].reason


def test_on_call_rollback_of_the_registry_alone_is_reconciled_by_the_next_tick(world):
    w = world
    promote_v2(w)
    rollback_champion(w.reg, w.plog, "bad outputs reported")  # what the CLI does: no fleet at hand
    assert w.fleet.serving_versions() == ["v2"] * 3
    assert w.ctrl.tick().action == HOLD and w.ctrl.state == "idle"  # the watch ends: the champion moved
    assert w.ctrl.tick().action == HOLD and w.fleet.serving_versions() == ["v1"] * 3
    assert w.ctrl.tick() is None


def test_rollback_during_a_canary_aborts_it(world):
    w = world
    w.ctrl.consider("v2", *replay(0.0, 0.3))
    assert w.ctrl.rollback("wrong data window").action == ROLLBACK
    assert w.fleet.canary is None and w.ctrl.state == "idle" and "v2" in w.reg.blocked()
    assert all(r.swaps == [] for r in w.replicas)


def test_rolling_back_to_plain_decoding_and_nothing_further(tmp_path, registry_template):
    w = make_world(tmp_path, registry_template)  # v1 replaced plain decoding: its previous is 'none'
    assert w.ctrl.rollback("draft overhead").action == ROLLBACK
    assert w.fleet.serving_versions() == [PLAIN] * 3 and w.reg.champion() == PLAIN and "v1" in w.reg.blocked()
    with pytest.raises(ValueError, match="nothing to roll back"):
        w.ctrl.rollback()


# ---- pins, blocks, refusals --------------------------------------------------------------------------
def test_a_pinned_registry_promotes_nothing(world):
    w = world
    w.ctrl.pin("v1", "incident 42")
    d = w.ctrl.consider("v2", *replay(0.0, 0.3))
    assert d.action == HOLD and "pinned" in d.reason and w.ctrl.state == "idle" and w.fleet.canary is None
    assert w.events() == ["pinned", "considered"]
    w.ctrl.unpin()
    assert w.ctrl.consider("v2", *replay(0.0, 0.3)).action == PROMOTE
    assert w.events() == ["pinned", "considered", "unpinned", "considered", "canary_started"]


def test_a_pin_ends_a_running_canary(world):
    w = world
    w.ctrl.consider("v2", *replay(0.0, 0.3))
    w.reg.pin("v1", "set by heads pin")  # outside the controller
    d = w.run_canary()
    assert d.action == HOLD and "pinned" in d.reason and w.fleet.canary is None and w.ctrl.state == "idle"
    assert all(r.swaps == [] for r in w.replicas)


def test_pinning_another_version_makes_it_the_champion_and_the_fleet_follows(world):
    w = world
    d = w.ctrl.pin("v3", "known good")
    assert d.action == HOLD and w.reg.champion() == "v3" and w.reg.pinned().version == "v3"
    assert w.fleet.serving_versions() == ["v3"] * 3
    last = w.plog.read().events[-1]
    assert (last.event, last.candidate, last.champion, last.by) == ("pinned", "v3", "v1", "on-call")


@pytest.mark.parametrize("candidate, words", [("nope", "not a head version"), (PLAIN, "not a head version"),
                                              ("v1", "already is the champion")])
def test_candidates_that_cannot_be_considered(world, candidate, words):
    d = world.ctrl.consider(candidate, *replay(0.0, 0.3))
    assert d.action in (REJECT, HOLD) and words in d.reason and world.ctrl.state == "idle"
    assert world.events() == ["considered"]


def test_one_candidate_at_a_time(world):
    w = world
    w.ctrl.consider("v2", *replay(0.0, 0.3))
    d = w.ctrl.consider("v3", *replay(0.0, 0.4, candidate="v3"))
    assert d.action == HOLD and "busy" in d.reason and w.fleet.canary.version == "v2"


# ---- cold start: champion 'none' ---------------------------------------------------------------------
@pytest.mark.parametrize("head_tpot, action", [(0.03, PROMOTE), (0.05, REJECT)])
def test_cold_start_is_judged_by_wall_time_per_token(tmp_path, registry_template, head_tpot, action):
    w = make_world(tmp_path, registry_template, champion=PLAIN, speed={PLAIN: 0.04, "v2": head_tpot})
    _, candidate = replay(0.0, 0.3)
    d = w.ctrl.consider("v2", [], candidate)  # plain decoding's replay is implied: 1 token per step
    assert d.action == PROMOTE and d.evidence["tail_champion"] == 1.0
    assert "cold-start" in w.plog.read().events[-1].reason
    d = w.run_canary()
    assert d.action == action and d.evidence["metric"] == "tpot_s"
    assert w.reg.champion() == ("v2" if action == PROMOTE else PLAIN)
    assert w.fleet.serving_versions() == [w.reg.champion()] * 3


def test_status(world):
    world.ctrl.consider("v2", *replay(0.0, 0.3))
    st = world.ctrl.status()
    assert st["state"] == "canary" and st["canary"]["candidate"] == "v2" and st["champion"] == "v1"
    assert st["serving"] == ["v1"] * 3


# ---- layering ------------------------------------------------------------------------------------
def test_policies_never_import_torch_or_the_trainer():
    code = ("import sys; import policies.controller, policies.gates, policies.fleet, policies.canary, "
            "policies.log, policies.render, policies.config, policies.actor, policies.cli; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'trainer', 'serving', 'ray')); "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_evidence_replayed_against_an_earlier_champion_is_never_judged(world):
    """v3's replay was measured against v1; v2 was promoted meanwhile: v3 is rejected as stale (even though its
    numbers would pass) and the log says against which champion it was replayed."""
    w = world
    stale_champion, v3 = replay(0.0, 0.4, candidate="v3")  # against v1
    promote_v2(w)
    w.traffic.serve(300)
    w.ctrl.tick()  # the watch ends: idle again, v2 champion
    assert w.ctrl.state == "idle" and w.reg.champion() == "v2"
    decision = w.ctrl.consider("v3", stale_champion, v3)
    assert decision.action == REJECT and "stale evidence" in decision.reason and "v1" in decision.reason
    last = w.plog.read().events[-1]
    assert last.event == "rejected" and last.candidate == "v3" and "replayed against v1" in last.reason
    assert w.ctrl.state == "idle" and w.fleet.canary is None  # nothing started
    fresh = replay(0.0, 0.4, champion="v2", candidate="v3")  # replayed against the champion of now
    assert w.ctrl.consider("v3", *fresh).action == PROMOTE


# ---- which canary: health for exact (greedy) replay, evidence otherwise --------------------------------
def test_exact_replay_gets_a_health_canary_and_the_log_says_which(tmp_path, registry_template):
    w = make_world(tmp_path, registry_template, speed={"v2": 0.04})
    w.ctrl.config = CFG.model_copy(update={"sequential": True, "canary_health_requests": 30})
    assert w.ctrl.consider("v2", *replay(0.0, 0.3), exact_replay=True).action == PROMOTE
    started = w.plog.read().events[-1]
    assert started.event == "canary_started" and "health canary" in started.reason
    assert started.evidence["canary"] == "health" and w.ctrl.status()["canary"]["mode"] == "health"
    w.traffic.serve(40)  # ~20 a head at canary_fraction 0.5: not enough yet
    assert w.ctrl.tick().action == CONTINUE
    d = w.run_canary(40)
    assert d.action == PROMOTE and "healthy live" in d.reason and w.reg.champion() == "v2"


def test_a_health_canary_stops_a_head_that_is_slower_live(tmp_path, registry_template):
    w = make_world(tmp_path, registry_template, speed={"v1": 0.04, "v2": 0.08})
    w.ctrl.config = CFG.model_copy(update={"sequential": True, "canary_health_requests": 200})
    assert w.ctrl.consider("v2", *replay(0.0, 0.3), exact_replay=True).action == PROMOTE
    d = w.run_canary(120)
    assert d.action == REJECT and "time per output token is higher" in d.reason and w.reg.champion() == "v1"


def test_sampled_replay_gets_the_evidence_canary(tmp_path, registry_template):
    w = make_world(tmp_path, registry_template)
    w.ctrl.config = CFG.model_copy(update={"sequential": True})
    assert w.ctrl.consider("v2", *replay(0.0, 0.3), exact_replay=False).action == PROMOTE
    started = w.plog.read().events[-1]
    assert "evidence canary" in started.reason and started.evidence["canary"] == "evidence"
    forced = CFG.model_copy(update={"canary_mode": "evidence"})
    from policies.controller import canary_mode
    assert canary_mode(forced, "v1", True) == "evidence" and canary_mode(CFG, "none", True) == "cold_start"


# ---- test-then-train evidence: the sequential offline gate, looked at as the evidence grows -------------------
def test_growing_evidence_is_judged_at_every_look_and_logged_once(tmp_path, registry_template):
    """consider(sequential=True): an undecided look leaves the policy idle and writes nothing to the log after
    the first `considered`; the look at which the tail test passes starts the canary."""
    w = make_world(tmp_path, registry_template)
    w.ctrl.config = CFG.model_copy(update={"min_samples": 20, "tail_quantile": 0.25})
    champ, cand = replay(0.0, 0.3, n=300)
    looks = []
    for n in range(5, 301, 5):
        d = w.ctrl.consider("v2", champ[:n], cand[:n], exact_replay=True, sequential=True)
        looks.append(d.action)
        if d.action != CONTINUE:
            break
    assert looks[-1] == PROMOTE and set(looks[:-1]) == {CONTINUE} and len(looks) > 1
    assert w.events() == ["considered", "canary_started"] and w.ctrl.state == "canary"
    started = w.plog.read().events[-1]
    assert started.evidence["gate"] == "offline_sequential" and started.evidence["canary"] == "health"


def test_evidence_that_closes_undecided_is_rejected_as_inconclusive(tmp_path, registry_template):
    w = make_world(tmp_path, registry_template)
    w.ctrl.config = CFG.model_copy(update={"min_samples": 20, "tail_quantile": 0.25})
    champ, cand = replay(0.0, 0.0, n=30)
    assert w.ctrl.consider("v2", champ, cand, sequential=True).action == CONTINUE
    assert w.ctrl.status()["gathering"] == ["v2"]
    d = w.ctrl.consider("v2", champ, cand, sequential=True, final=True)
    assert d.action == REJECT and "inconclusive" in d.reason and w.ctrl.status()["gathering"] == []
    assert w.events() == ["considered", "rejected"] and w.ctrl.state == "idle"


def test_the_feed_rereads_growing_evidence_and_refuses_a_malformed_file(tmp_path, registry_template):
    """loop.candidates.CandidateFeed with test-then-train candidates: each is re-read whenever its evidence
    grew (not otherwise), judged by the real controller, and a malformed evidence file is refused with its
    reason and never considered again."""
    import asyncio

    import torch

    from adaptive_eagle.checkpoint import HeadMeta
    from adaptive_eagle.evidence import CandidateEvidence, evidence_path, write_evidence
    from loop.candidates import CandidateFeed

    w = make_world(tmp_path, registry_template)
    w.ctrl.config = CFG.model_copy(update={"min_samples": 20, "tail_quantile": 0.25})

    class Policy:  # the policy actor's two calls, on the real controller
        async def status(self):
            return w.ctrl.status()

        async def consider(self, *args, **kw):
            return w.ctrl.consider(*args, **kw)

    feed = CandidateFeed(w.reg)
    loaded = w.reg.load("v2")
    for name in ("c1", "c2"):
        meta = HeadMeta.new(name, loaded.meta.target_name, loaded.meta.target_fingerprint, parent="v1",
                            metrics={"replay": {"evidence": "prequential", "champion_version": "v1"}})
        w.reg.register(loaded.head, meta, dtype=torch.float32)
    champ, cand = replay(0.0, 0.3, n=300)
    ev = CandidateEvidence(version="c1", champion="v1")
    write_evidence(w.reg.root, ev)
    evidence_path(w.reg.root, "c2").write_text("{not json")
    assert asyncio.run(feed.step(Policy())).action == CONTINUE  # c1: no rows yet
    assert "c2" in feed.refused and "malformed" in feed.refused["c2"] and set(feed.gathering) == {"c1"}
    assert asyncio.run(feed.step(Policy())) is None  # nothing grew: nothing looked at
    decisions = []
    for a, b in zip(champ, cand):
        ev.add(a.request_id, a.domain, a.accept_length, b.accept_length, True)
        if len(ev.rows) % 10 == 0:
            write_evidence(w.reg.root, ev)
            decisions.append(asyncio.run(feed.step(Policy())))
            if decisions[-1] is not None and decisions[-1].action == PROMOTE:
                break
    assert decisions[-1].action == PROMOTE and feed.considered == [("c1", PROMOTE)] and w.ctrl.state == "canary"
    assert w.events() == ["considered", "canary_started"] and not feed.gathering


def test_the_watch_baseline_is_the_previous_champions_recent_requests_not_only_its_canary_share(
        tmp_path, registry_template):
    """A health canary of 5 requests a head leaves the old champion ~5 canary samples: the watch compares the new
    champion with the old one's last rollback_window live requests instead, and a baseline under
    collapse_min_requests is never compared (only a collapse rolls back)."""
    from policies.gates import rollback_check
    from tests.policies.helpers import samples

    w = make_world(tmp_path, registry_template)
    w.ctrl.config = CFG.model_copy(update={"sequential": True, "canary_health_requests": 5})
    w.traffic.serve(300)  # v1 serves alone before the candidate arrives
    assert w.ctrl.consider("v2", *replay(0.0, 0.3), exact_replay=True).action == PROMOTE
    assert w.run_canary(48).action == PROMOTE  # 24 a head: a health canary cannot fail before collapse_min_requests
    base = w.ctrl._watch.baseline
    assert len(base) == CFG.rollback_window and {s.head_version for s in base} == {"v1"}
    few = samples([3.0] * 4, "v1")
    low = samples([1.5] * CFG.rollback_window, "v2", ids="x")
    assert rollback_check(few, low, CFG).action == HOLD  # 4 baseline requests: nothing to compare a tail with


def test_a_promotion_names_the_domains_its_offline_evidence_moved_up_and_down(world):
    """On-call reads which traffic a promoted head helps and hurts: the offline evidence's per-domain means
    (point estimates, with the records behind each), up and down, in the promoted line and its evidence."""
    w = world
    champ, cand = replay(0.0, 0.3, n=300)
    # the last 60 records are math, which the candidate serves 1% worse (within the 5% domain tolerance)
    champ = [dataclasses.replace(s, domain="code" if i < 240 else "math") for i, s in enumerate(champ)]
    cand = [dataclasses.replace(s, domain="code" if i < 240 else "math",
                                accept_length=max(1.0, champ[i].accept_length * 0.99) if i >= 240 else s.accept_length)
            for i, s in enumerate(cand)]
    assert w.ctrl.consider("v2", champ, cand).action == PROMOTE
    assert w.run_canary().action == PROMOTE
    promoted = next(e for e in w.plog.read().events if e.event == "promoted")
    assert "helps code" in promoted.reason and "hurts math" in promoted.reason, promoted.reason
    assert "(-1.0%, 60 records" in promoted.reason and "point estimates" in promoted.reason
    assert {d["domain"] for d in promoted.evidence["offline_domains"]} == {"code", "math"}


def test_the_domains_line_says_nothing_without_domains_and_marks_unchecked_ones():
    from policies.gates import domains_line

    assert domains_line([]) == ""
    row = {"domain": "code", "n_champion": 4, "n_candidate": 4, "mean_champion": 2.0, "mean_candidate": 2.2,
           "checked": False}
    assert domains_line([row]).endswith("helps code 2.000->2.200 (+10.0%, 4 records, unchecked)")
