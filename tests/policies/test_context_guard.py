"""The context-length guard of the gates: a candidate that gains on short requests and loses on long ones is
rejected with a reason naming the context bucket (every gate that carries evidence: the bootstrap offline gate,
the sequential offline gate on test-then-train evidence, the live canaries), one that gains on both passes,
and samples without a context position (evidence written before it existed) are not sliced."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from policies.config import PolicyConfig, PolicyConfigError
from policies.gates import (CONTINUE, PROMOTE, REJECT, canary_gate, compare, offline_gate, sequential_canary_gate,
                            sequential_offline_gate)
from tests.policies.helpers import samples, small_config

SHORT, LONG = 300, 5000  # context positions: buckets 0-512 and 4-8k
CFG = small_config(sequential=False)


def with_context(xs, context: int):
    return [replace(s, context=context) for s in xs]


def short_gain_long_loss(long_shift: float = -0.12, short_shift: float = 0.3, seed: int = 0,
                         paired: bool = True):
    """900 short records improve clearly; 300 long ones (which accept more, so they are not the overall tail)
    change by `long_shift` in the latent (-0.12: about 8% lower mean). Untagged: one domain, so only the
    context slice can see the loss. Paired (replay) or, with paired=False, different requests per head."""
    rng = np.random.default_rng(seed)
    short, long_ = rng.normal(0.0, 0.4, 900), rng.normal(1.0, 0.3, 300)
    other = (lambda x: x) if paired else (lambda x: rng.permutation(x) + rng.normal(0, 0.05, len(x)))
    ids = ("s", "l") if paired else ("cs", "cl")
    champion = with_context(samples(1 + np.exp(short), "v1", ids="s"), SHORT) + \
        with_context(samples(1 + np.exp(long_), "v1", ids="l"), LONG)
    candidate = with_context(samples(1 + np.exp(other(short) + short_shift), "v2", ids=ids[0]), SHORT) + \
        with_context(samples(1 + np.exp(other(long_) + long_shift), "v2", ids=ids[1]), LONG)
    return champion, candidate


def without_context(pair):
    return tuple([replace(s, context=None) for s in side] for side in pair)


def test_the_scenario_is_what_it_claims():
    cmp = compare(*short_gain_long_loss(), CFG, paired=True)
    assert cmp.ci_low > 0 and cmp.mean_gain > 0  # the overall tail and mean improve
    assert [r.domain for r in cmp.domains] == ["-"] and not cmp.domains[0].checked  # no domain to guard
    rows = {r.bucket: r for r in cmp.contexts}
    assert list(rows) == ["0-512", "4-8k"] and rows["4-8k"].n_candidate == 300
    assert rows["4-8k"].checked and rows["4-8k"].regressed and rows["4-8k"].mean_candidate < rows["4-8k"].mean_champion
    assert rows["0-512"].checked and not rows["0-512"].regressed


def test_a_gain_on_short_and_a_loss_on_long_requests_is_rejected_naming_the_bucket():
    d = offline_gate(*short_gain_long_loss(), CFG)
    assert d.action == REJECT, d.reason
    assert d.reason.startswith("context length 4-8k tokens (mean accept length ") and "300 requests" in d.reason
    assert "more than the 3% tolerance" in d.reason and d.reason.endswith(".") and d.reason.count(". ") == 0
    assert {r["bucket"]: r["regressed"] for r in d.evidence["contexts"]} == {"0-512": False, "4-8k": True}


def test_a_gain_on_both_passes_and_the_switch_and_tolerance_decide_the_loss():
    both = short_gain_long_loss(long_shift=0.1)
    assert offline_gate(*both, CFG).action == PROMOTE
    assert offline_gate(*short_gain_long_loss(), small_config(sequential=False, context_guard=False)).action \
        == PROMOTE
    assert offline_gate(*short_gain_long_loss(), small_config(sequential=False, domain_tolerance=0.2)).action \
        == PROMOTE
    # a bucket with too few requests of either head is not checked (the per-domain minimum)
    cfg = small_config(sequential=False, min_domain_samples=301, min_samples=400)
    d = offline_gate(*short_gain_long_loss(), cfg)
    assert d.action == PROMOTE and not {r["bucket"]: r for r in d.evidence["contexts"]}["4-8k"]["checked"]


def test_other_edges_slice_other_buckets():
    cfg = small_config(sequential=False, context_edges=(0, 1024, 4096))
    d = offline_gate(*short_gain_long_loss(), cfg)
    assert d.action == REJECT and d.reason.startswith("context length 4k+ tokens")


def test_samples_without_a_context_position_are_not_sliced():
    """Evidence written before samples carried a context position: the gate decides as it did then."""
    old = without_context(short_gain_long_loss())
    d = offline_gate(*old, CFG)
    assert d.action == PROMOTE and d.evidence["contexts"] == []
    mixed = (old[0][:600] + short_gain_long_loss()[0][600:], old[1][:600] + short_gain_long_loss()[1][600:])
    rows = {r.bucket: r for r in compare(*mixed, CFG, paired=True).contexts}
    assert rows["0-512"].n_champion == 300 and rows["4-8k"].n_champion == 300  # only the samples that have one


def test_the_sequential_offline_gate_waits_then_rejects_naming_the_bucket():
    cfg = small_config(min_samples=200, offline_max_samples=5000, tail_quantile=0.25)
    champion, candidate = short_gain_long_loss()
    order = np.random.default_rng(1).permutation(len(champion))  # arrival order: short and long interleaved
    champion, candidate = [champion[i] for i in order], [candidate[i] for i in order]
    open_ = sequential_offline_gate(champion, candidate, cfg)
    assert open_.action == CONTINUE and "context length 4-8k tokens" in open_.reason, open_.reason
    final = sequential_offline_gate(champion, candidate, cfg, final=True)
    assert final.action == REJECT and "but context length 4-8k tokens" in final.reason
    assert "the evidence closed" in final.reason
    assert sequential_offline_gate(*without_context((champion, candidate)), cfg).action == PROMOTE
    both = short_gain_long_loss(long_shift=0.1)
    assert sequential_offline_gate([both[0][i] for i in order], [both[1][i] for i in order], cfg).action == PROMOTE


def test_the_live_canaries_reject_naming_the_bucket():
    champion, candidate = short_gain_long_loss(paired=False)
    boot = canary_gate(champion, candidate, small_config(sequential=False, canary_min_requests=200))
    assert boot.action == REJECT and boot.reason.startswith("context length 4-8k tokens"), boot.reason
    seq = sequential_canary_gate(champion, candidate, small_config(canary_min_requests=200))
    assert seq.action == REJECT and seq.reason.startswith("context length 4-8k tokens"), seq.reason
    assert sequential_canary_gate(*without_context((champion, candidate)),
                                  small_config(canary_min_requests=200)).action == PROMOTE


@pytest.mark.parametrize("edges", [(0,), (1, 2), (0, 512, 512), tuple(range(0, 17 * 512, 512))])
def test_context_edges_are_range_checked(edges):
    with pytest.raises(PolicyConfigError, match="context_edges.*the first 0, strictly increasing"):
        PolicyConfig.make(context_edges=edges)


def test_the_guard_is_on_by_default():
    cfg = PolicyConfig()
    assert cfg.context_guard and cfg.context_edges == (0, 512, 1024, 2048, 4096, 8192)


def test_test_then_train_evidence_carries_the_context_to_the_gate():
    """The default evidence (prequential rows written by the trainer) reaches the gate with each record's
    context position; rows of older five-element files are read, and only those are left unsliced."""
    from adaptive_eagle.evidence import CandidateEvidence
    from loop.candidates import evidence_samples

    cfg = small_config(min_samples=200, offline_max_samples=5000, tail_quantile=0.25)
    champion, candidate = short_gain_long_loss()
    order = np.random.default_rng(1).permutation(len(champion))
    ev = CandidateEvidence(version="v2", champion="v1")
    for i in order:
        ev.add(champion[i].request_id, None, champion[i].accept_length, candidate[i].accept_length, True,
               champion[i].context)
    ev = CandidateEvidence.model_validate_json(ev.model_dump_json())  # as the policy reads the file
    champ, cand = evidence_samples(ev)
    assert [s.context for s in champ] == [champion[i].context for i in order] == [s.context for s in cand]
    final = sequential_offline_gate(champ, cand, cfg, final=True)
    assert final.action == REJECT and "context length 4-8k tokens" in final.reason
    old = CandidateEvidence.model_validate({"version": "v2", "champion": "v1", "rows": [r[:5] for r in ev.rows]})
    champ5, cand5 = evidence_samples(old)
    assert all(s.context is None for s in champ5 + cand5)
    assert sequential_offline_gate(champ5, cand5, cfg).action == PROMOTE
