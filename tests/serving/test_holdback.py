"""The holdback arm on a reference replica: a stable share of requests decodes with the frozen baseline head,
prepared next to the served one for as long as the replica runs, losslessly; each response says its arm; the
gateway's metrics show the frozen arm against the served one per domain (ae_loop_tpot_gain); a stack that asks
for the arm on SGLang replicas is refused with a reason."""

import re

import pytest
from prometheus_client import generate_latest

from policies.holdback import BLOCK, MIN_PER_ARM, Holdback
from serving.messages import DecodeRequest, Finished, SpecMetrics
from serving.metrics import GatewayMetrics

PROMPT = "w5 w9 w12 w7 w30"


def request(rid: str, **kw) -> DecodeRequest:
    return DecodeRequest(request_id=rid, messages=({"role": "user", "content": PROMPT},), max_tokens=8, **kw)


def test_a_replica_holdback_arm_decodes_its_share_with_the_frozen_head_losslessly(stack):
    server = stack.server("v2", "solo")
    want = stack.plain_text([{"role": "user", "content": PROMPT}], 8).text
    try:
        res = server.backend.set_holdback("v1", 0.3)
        assert res.ok and server.status().info["holdback"] == {"version": "v1", "fraction": 0.3}
        ids = [f"req-{i}" for i in range(16)]
        out = {rid: server.generate(request(rid)) for rid in ids}
        assert all(isinstance(f, Finished) and f.text == want for f in out.values())  # lossless on either arm
        held = {rid for rid in ids if Holdback("v1", 0.3).takes(rid)}
        assert held and held != set(ids)
        assert {rid: (f.spec.arm, f.spec.head_version) for rid, f in out.items()} == {
            rid: ("holdback", "v1") if rid in held else ("served", "v2") for rid in ids}
        assert server.generate(request(next(iter(held)), head="v2")).spec.arm == "served"  # asked for a head
        assert server.swap_head("v1").ok  # the arm stays, whatever serves
        assert server.generate(request(next(iter(held)))).spec.arm == "holdback"
        refused = server.backend.set_holdback("v9", 0.3)
        assert not refused.ok and "v9" in refused.message and server.status().info["holdback"] is None
        assert server.backend.set_holdback(None, 0.0).ok
        assert all(server.generate(request(rid)).spec.arm == "served" for rid in held)
    finally:
        server.close()


def test_the_gateway_exports_the_loops_gain_per_domain_from_the_two_arms():
    m = GatewayMetrics()

    def spec(arm, tpot, accept):
        return SpecMetrics(head_version="v2" if arm == "served" else "v1", accept_length=accept, verify_steps=4,
                           draft_tokens=8, accepted_drafts=4, tpot_s=tpot, domain="code", arm=arm)

    for i in range(MIN_PER_ARM):
        m.observe(spec("served", 0.020, 2.4), 16)
        m.observe(spec("holdback", 0.030, 1.6), 16)
    text = generate_latest(m.registry).decode()
    assert 'ae_loop_tpot_gain{domain="code",stat="point"} 1.5' in text
    assert 'ae_loop_accept_gain{domain="code",stat="point"} 1.49999' in text
    assert 'ae_holdback_requests_total{arm="holdback",domain="code"} 20.0' in text
    assert 'ae_loop_domain_accept_length{arm="served",domain="code"} 2.4' in text
    assert 'ae_loop_domain_accept_length{arm="holdback",domain="code"} 1.6' in text
    assert "ae_loop_forgetting_pct{" not in text  # no block closed yet
    for level in (2.4, 2.4, 1.8):  # three blocks of served requests; the newest lost a quarter of the best's
        for _ in range(BLOCK):
            m.observe(spec("served", 0.020, level), 16)
    text = generate_latest(m.registry).decode()
    point = re.search(r'ae_loop_forgetting_pct\{domain="code",stat="point"\} (\S+)', text)
    assert point and float(point.group(1)) == pytest.approx(25.0)


def test_a_holdback_arm_on_sglang_replicas_is_refused_with_a_reason():
    from loop.check import _holdback
    from loop.config import StackConfig

    problems: list = []
    cfg = StackConfig.model_validate({"serving": {"backend": "sglang", "holdback_fraction": 0.05,
                                                  "sglang": {"model_path": "/m", "draft_model_path": "/d"}}})
    _holdback(cfg, problems, [])
    assert len(problems) == 1 and "one draft model" in problems[0].message
    problems.clear()
    _holdback(StackConfig.model_validate({"serving": {"holdback_fraction": 0.05}}), problems, [])
    assert problems == []
