"""Drift signal: a sustained drop of a domain's live accept length is flagged, noise is not."""

import random

from trainer.drift import DriftMonitor


def test_sustained_drop_is_flagged_and_recovery_clears_it():
    m = DriftMonitor(alpha=0.2, drop=0.05, min_records=10, sustain=5)
    rng = random.Random(0)
    events = [m.observe("code", 1.5 + rng.uniform(-0.02, 0.02), "v1") for _ in range(50)]
    assert not any(events)
    events = [m.observe("code", 1.2, "v1") for _ in range(30)]
    drops = [e for e in events if e is not None]
    assert len(drops) == 1 and drops[0].kind == "drop" and drops[0].domain == "code"
    assert m.weights()["code"] == m.boost
    back = [m.observe("code", 1.5, "v1") for _ in range(30)]
    assert any(e is not None and e.kind == "recovered" for e in back) and m.weights()["code"] == 1.0


def test_a_new_domain_below_the_overall_level_is_flagged():
    m = DriftMonitor(alpha=0.2, min_records=10, sustain=5)
    for _ in range(40):
        m.observe("english", 1.5, "v1")
    events = [m.observe("code", 1.3, "v1") for _ in range(20)]
    assert any(e is not None and e.kind == "drop" for e in events)
    assert m.table()["code"]["flagged"]


def test_a_new_champion_starts_new_references():
    m = DriftMonitor(alpha=0.2, min_records=5, sustain=3)
    for _ in range(20):
        m.observe("code", 1.5, "v1")
    m.observe("code", 1.1, "v2")
    assert m.head_version == "v2" and m.table()["code"]["records"] == 1
