"""Every decision states its power: a health canary never passes before it could have failed, and the lines
that pass a canary or end a watch say what harm their sample could and could not have detected, at the demo's
and prod's settings (adaptive_eagle_cli/demo/config.py, ops/prod.yaml)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from policies.config import PolicyConfig
from policies.gates import (CONTINUE, HOLD, PROMOTE, REJECT, health_canary_able_at, health_canary_gate,
                            rollback_check, sequential_offline_gate)
from policies.samples import RequestSample
from policies.sequential import first_bounded

REPO = Path(__file__).resolve().parents[2]


def demo_policy() -> PolicyConfig:
    import tempfile

    from adaptive_eagle_cli.demo.config import DemoConfig, demo_stack_config

    with tempfile.TemporaryDirectory() as d:
        return demo_stack_config(DemoConfig.make(), d).policy.gates()


def prod_policy() -> PolicyConfig:
    fields = yaml.safe_load((REPO / "ops" / "prod.yaml").read_text())["policy"]
    return PolicyConfig(**{k: v for k, v in fields.items() if k in PolicyConfig.model_fields})


def live(rng, n: int, version: str, scale: float = 1.0, tpot_scale: float = 1.0) -> list[RequestSample]:
    acc = np.maximum(1.0, (1.0 + rng.gamma(4.0, 0.18, n)) * scale)
    tpot = 0.05 * tpot_scale * rng.lognormal(0.0, 0.2, n)
    return [RequestSample(float(a), version, None, f"{version}-{i}", tpot_s=float(t), finished_at=float(i))
            for i, (a, t) in enumerate(zip(acc, tpot))]


@pytest.mark.parametrize("which", ["demo", "prod"])
def test_a_health_canary_passes_only_once_it_could_have_failed_and_says_what_it_could_detect(which):
    cfg = demo_policy() if which == "demo" else prod_policy()
    able = health_canary_able_at(cfg)
    alpha = (1 - cfg.confidence_level) / 4
    assert able >= max(cfg.canary_health_requests, cfg.collapse_min_requests, first_bounded(0.5, alpha))
    rng = np.random.default_rng(0)
    a, b = live(rng, able, "v1"), live(rng, able, "v2")
    early = health_canary_gate(a[:able - 1], b[:able - 1], cfg)
    assert early.action == CONTINUE
    if able > cfg.canary_health_requests:  # the demo's 5: the collapse rule needs 10, the bounds 8
        assert f"cannot fail before {able}" in early.reason
    passed = health_canary_gate(a, b, cfg)
    assert passed.action == PROMOTE, passed.reason
    drop, rise = passed.evidence["detectable_accept_drop"], passed.evidence["detectable_tpot_rise"]
    assert drop is not None and rise is not None and drop >= cfg.canary_health_margin
    assert f"could detect a median accept length {drop:.0%} or more below" in passed.reason
    assert "a smaller harm could not be detected" in passed.reason
    # what it says it could detect, it does: a candidate that much worse is rejected at the same size, in most runs
    worse = 1 - min(0.9, drop + 0.1)
    rejected = sum(health_canary_gate(live(rng, able, "v1"), live(rng, able, "v2", scale=1.0), cfg).action == REJECT
                   for _ in range(5))
    assert rejected == 0
    rejected = sum(health_canary_gate(live(rng, able, "v1"), [RequestSample(max(1.0, s.accept_length * worse), "v2",
                                                                            None, s.request_id, tpot_s=s.tpot_s)
                                                              for s in live(rng, able, "v2")], cfg).action == REJECT
                   for _ in range(20))
    assert rejected >= 15, (which, drop, rejected)


def test_the_demos_five_request_canary_no_longer_passes_unchecked():
    """The kept demo log showed 'median accept length 2.065 -> 1.685 ... healthy' after 5 requests a head, when
    its bounds were infinite and the collapse rule needed 10: nothing was checked."""
    cfg = demo_policy()
    assert cfg.canary_health_requests == 5 and health_canary_able_at(cfg) == 10
    rng = np.random.default_rng(1)
    d = health_canary_gate(live(rng, 5, "v1", scale=1.2), live(rng, 5, "v2"), cfg)
    assert d.action == CONTINUE and "need 10 live requests per head" in d.reason


@pytest.mark.parametrize("which", ["demo", "prod"])
def test_a_watch_that_passes_says_what_fall_it_could_have_seen(which):
    cfg = demo_policy() if which == "demo" else prod_policy()
    rng = np.random.default_rng(2)
    base, after = live(rng, 400, "v1"), live(rng, cfg.rollback_window, "v2")
    d = rollback_check(base, after, cfg)
    assert d.action == HOLD and "could detect a fall of about" in d.reason and "could pass unseen" in d.reason
    pct = int(re.search(r"or more \((\d+)%\)", d.reason).group(1))
    assert pct >= round(100 * cfg.rollback_margin)


def paired(rng, n: int, gain: float) -> tuple[list[RequestSample], list[RequestSample]]:
    acc = np.maximum(1.0, 1.0 + rng.gamma(2.0, 0.5, n))
    a = [RequestSample(float(x), "v1", "english", f"r{i}", finished_at=float(i)) for i, x in enumerate(acc)]
    b = [RequestSample(float(x) * (1 + gain), "v2", "english", f"r{i}", finished_at=float(i))
         for i, x in enumerate(acc)]
    return a, b


@pytest.mark.parametrize("which", ["demo", "prod"])
def test_an_offline_gate_that_closes_without_a_promotion_says_what_it_could_have_shown(which):
    """An inconclusive close states a gain on every record its records would have promoted (and one 0.5% smaller
    they would not), and that figure is true: a head with that gain on every record passes the same gate on the
    same records (and at a window too small to bet on, the line says it could show nothing)."""
    cfg = demo_policy() if which == "demo" else prod_policy()
    rng = np.random.default_rng(1)
    small = 20 if which == "demo" else 300  # under the 60 / 400 at which each first detects a gain
    a, b = paired(rng, small, 0.0)
    shut = sequential_offline_gate(a, b, cfg, final=True)
    assert shut.action == REJECT
    assert shut.evidence["detectable_tail_gain"] is None, shut.reason
    assert "could not have promoted even a head twice as good" in shut.reason
    n = 1500 if which == "demo" else 4000
    a, b = paired(rng, n, 0.0)
    shut = sequential_offline_gate(a, b, cfg, final=True)
    assert shut.action == REJECT
    g = shut.evidence["detectable_tail_gain"]
    assert g is not None and 0 < g < 1, shut.reason
    assert f"would have promoted a head {g:.1%} better on every record, and not one {g - 0.005:.1%} better" \
        in shut.reason
    lifted = [RequestSample(s.accept_length * (1 + g), "v2", s.domain, s.request_id, finished_at=s.finished_at)
              for s in a]
    assert sequential_offline_gate(a, lifted, cfg, final=True).action == PROMOTE
