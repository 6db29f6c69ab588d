"""Acceptance replay reproduces what the engine achieved on greedy traffic, step for step."""

import numpy as np
import pytest
import torch

from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
from adaptive_eagle.trace import SamplingParams, TraceRecord
from adaptive_eagle.tree import chain_tree
from tests.adaptive_eagle.test_engine import tiny_setup
from trainer.replay import RecordReplay, ReplayScore, TreeParams, accepted_along, replay_heads, replay_record

SERVE = dict(depth=4, topk=4, num_draft_tokens=12, cost_aware=False, prompt_lookup=False, suffix_drafting=False,
             calibration_dir="")


def captured_records(target, head, prompts, max_tokens=40):
    engine = SpeculativeEngine(target, head, EngineConfig(**SERVE))
    engine.eos_ids = set()
    return [engine.generate(p, SamplingParams(max_tokens=max_tokens), capture=True, request_id=f"r{i}").trace
            for i, p in enumerate(prompts)]


def test_accepted_along_follows_the_longest_matching_path():
    tree = chain_tree([5, 6, 7])
    assert accepted_along(tree, [5, 6, 7, 8]) == 3
    assert accepted_along(tree, [5, 6, 9]) == 2
    assert accepted_along(tree, [4]) == 0
    assert accepted_along(tree, [5]) == 1  # the continuation ends


def test_replay_of_greedy_traffic_equals_what_the_engine_accepted_step_for_step():
    target, head = tiny_setup(seed=3)
    torch.manual_seed(0)
    prompts = [torch.randint(0, 32, (n,)).tolist() for n in (5, 9, 14, 7)]
    records = captured_records(target, head, prompts)
    tree = TreeParams(**{k: SERVE[k] for k in ("depth", "topk", "num_draft_tokens")})
    total = 0
    for rec in records:
        got = replay_record(head, rec, torch.from_numpy(rec.aux_hidden), tree)
        want = tuple(s.accept_length for s in rec.steps)
        # the engine's last step may accept past max_tokens (cut afterwards); the record ends there
        assert got.accepted[:-1] == want[: len(got.accepted) - 1], rec.request_id
        assert got.accept_length == pytest.approx(rec.accept_length_mean, abs=0.35)
        total += sum(want)
    assert total > 5  # the comparison saw accepted drafts, not only rejections


def test_regenerated_features_give_the_same_replay_as_captured_ones():
    target, head = tiny_setup(seed=4)
    rec = captured_records(target, head, [[3, 1, 4, 1, 5, 9, 2, 6]])[0]
    report = replay_heads({"h": head}, [rec, rec.without_hidden()], target, TreeParams(depth=4, topk=4,
                                                                                       num_draft_tokens=12))
    a, b = report.scores["h"].records
    assert a.accepted == b.accepted and a.steps > 5


def test_records_without_features_and_no_target_are_skipped_and_counted():
    target, head = tiny_setup(seed=4)
    rec = captured_records(target, head, [[3, 1, 4, 1, 5]], max_tokens=8)[0]
    other = TraceRecord(request_id="x", target_fingerprint="other", head_version=None, backend="reference",
                        input_ids=(1, 2, 3, 4), loss_mask=(0, 1, 1, 1))
    report = replay_heads({"h": head}, [rec.without_hidden(), other], None)
    assert report.skipped == {"no usable hidden states": 2} and report.scores["h"].records == ()
    report = replay_heads({"h": head}, [other], target)
    assert report.skipped == {"other target": 1}


def test_score_statistics():
    s = ReplayScore((RecordReplay("a", "code", (0, 1, 2)), RecordReplay("b", "english", (0, 0)),
                     RecordReplay("c", "code", ())))
    assert s.mean == pytest.approx(1 + 3 / 5)
    assert s.accept_lengths == [2.0, 1.0]
    assert s.alpha()[:3] == pytest.approx([2 / 5, 1 / 2, 0.0])
    assert set(s.by_domain()) == {"code", "english"}
    samples = s.samples("v1")
    assert [x["request_id"] for x in samples] == ["a", "b"] and samples[0]["accept_length"] == 2.0
    assert s.summary()["domains"]["code"]["records"] == 2
    assert np.isclose(s.quantile(0.0), 1.0)


def test_head_json_replay_blocks_are_written_through_the_evidence_model():
    """replay_metrics / prequential_metrics build adaptive_eagle.evidence.ReplayEvidence and write its block: the
    held-out one reads back with the same samples (plain decoding scores 1.0 for the champion), the test-then-train
    one holds only the kind, the champion and the tree."""
    from adaptive_eagle.evidence import ReplayEvidence
    from adaptive_eagle.versions import PLAIN
    from trainer.replay import prequential_metrics, replay_metrics

    cand = ReplayScore((RecordReplay("a", "code", (2, 1), context=40), RecordReplay("b", None, (0,)),
                        RecordReplay("c", "code", ())))
    tree = TreeParams()
    block = replay_metrics(cand, None, PLAIN, tree, {"other target": 1}, greedy_records=3)
    ev = ReplayEvidence.from_metrics({"replay": block})
    assert ev.evidence == "heldout" and ev.exact and ev.records == 3 and ev.champion is None
    assert ev.tree.model_dump() == tree.__dict__ and ev.skipped == {"other target": 1}
    assert block["samples"]["candidate"] == [["a", "code", 2.5, 40], ["b", None, 1.0]]
    assert block["samples"]["champion"] == [["a", "code", 1.0, 40], ["b", None, 1.0]]
    assert ev.to_metrics() == block and ev.candidate.model_dump(exclude_unset=True) == cand.summary()
    assert prequential_metrics("v1", tree) == {"evidence": "prequential", "champion_version": "v1",
                                               "tree": tree.__dict__, "records": 0}
