"""adaptive_eagle/evidence.py: a candidate's replay evidence as head.json records it (ReplayEvidence) — what the
trainer writes reads back the same, files written before a field existed still read, and a malformed block is
refused with a reason naming the field. (The test-then-train evidence file is covered with the trainer that
writes it, tests/trainer/test_nearline.py, and the policy that reads it, tests/policies/test_context_guard.py.)"""

import json
import subprocess
import sys

import pytest

from adaptive_eagle.evidence import (
    HELDOUT,
    PREQUENTIAL,
    EvidenceError,
    ReplayEvidence,
    ReplaySample,
    ReplaySamples,
    ReplayTree,
)
from adaptive_eagle.versions import PLAIN

TREE = {"depth": 5, "topk": 4, "num_draft_tokens": 16, "min_path_prob": 0.02}
SUMMARY = {"records": 2, "steps": 9, "accept_length": 2.1, "p5_accept_length": 1.6,
           "alpha": [0.8, 0.6, 0.4, 0.2, 0.1, 0.0, 0.0]}


def heldout(**kw) -> dict:
    return {"evidence": HELDOUT, "records": 2, "skipped": {"other target": 1}, "tree": TREE, "candidate": SUMMARY,
            "champion": None, "champion_version": "v1", "greedy_records": 2, "exact": True,
            "samples": {"candidate": [["r0", "chat", 2.5, 4100], ["r1", None, 1.75, 12]],
                        "champion": [["r0", "chat", 1.2, 4100], ["r1", None, 1.0, 12]]}, **kw}


def test_a_held_out_block_reads_back_as_written():
    ev = ReplayEvidence.from_metrics({"replay": heldout()})
    assert ev.evidence == HELDOUT and not ev.prequential and ev.exact and ev.champion_version == "v1"
    assert ev.tree == ReplayTree(**TREE) and ev.candidate.alpha[0] == 0.8 and ev.champion is None
    assert ev.samples.candidate[0] == ReplaySample(request_id="r0", domain="chat", accept_length=2.5, context=4100)
    assert ev.samples.champion[1].domain is None and ev.samples.champion[1].context == 12
    assert ev.to_metrics() == heldout()  # rows stay rows, null stays null, nothing added
    assert json.loads(json.dumps(ev.to_metrics())) == heldout()


def test_to_metrics_writes_exactly_the_fields_the_writer_set():
    ev = ReplayEvidence(evidence=PREQUENTIAL, champion_version="v1", tree=ReplayTree(**TREE), records=0)
    assert ev.to_metrics() == {"evidence": "prequential", "champion_version": "v1", "tree": TREE, "records": 0}
    assert ev.prequential and ev.samples == ReplaySamples() and not ev.exact  # defaults, not written
    row = ReplaySample(request_id="r", domain="d", accept_length=1.5)
    assert ReplayEvidence(samples=ReplaySamples(candidate=[row])).to_metrics() == {
        "samples": {"candidate": [["r", "d", 1.5]]}}  # no context: the three-element row of before


def test_blocks_written_before_a_field_existed_still_read():
    """The first near-line trainer wrote no evidence kind, no greedy_records / exact and three-element rows."""
    old = {"records": 1, "skipped": {}, "tree": TREE, "candidate": SUMMARY, "champion": SUMMARY,
           "champion_version": "v1", "samples": {"candidate": [["r0", "chat", 2.0]], "champion": [["r0", "chat", 1.5]]}}
    ev = ReplayEvidence.from_metrics({"replay": old})
    assert ev.evidence == HELDOUT and ev.greedy_records is None and not ev.exact
    assert [s.context for s in ev.samples.candidate + ev.samples.champion] == [None, None]
    assert ev.to_metrics() == old
    assert ReplayEvidence.from_metrics({"replay": {"champion_version": None}}).champion_version == PLAIN
    assert ReplayEvidence.from_metrics({"replay": {"samples": {}}}).champion_version == PLAIN
    assert ReplayEvidence.from_metrics({}) is None and ReplayEvidence.from_metrics(None) is None
    assert ReplayEvidence.from_metrics({"replay": {}}) is None and ReplayEvidence.from_metrics({"other": 1}) is None


@pytest.mark.parametrize("block, named", [
    (heldout(samples={"candidate": [["r0", "chat", 2.0, 1, 2]]}), "metrics.replay.samples.candidate.0: "),
    (heldout(samples={"candidate": [["r0", "chat"]]}), "context_position"),
    (heldout(samples={"champion": [["r0", "chat", 0.5]]}), "metrics.replay.samples.champion.0.accept_length"),
    (heldout(samples={"candidate": [["", "chat", 2.0]]}), "metrics.replay.samples.candidate.0.request_id"),
    (heldout(samples={"candidate": [["r0", "chat", 2.0, -1]]}), "metrics.replay.samples.candidate.0.context"),
    (heldout(samples={"candidates": []}), "metrics.replay.samples.candidates"),
    (heldout(tree={**TREE, "depth": 0}), "metrics.replay.tree.depth"),
    (heldout(tree={**TREE, "min_path_prob": 1.0}), "metrics.replay.tree.min_path_prob"),
    (heldout(candidate={**SUMMARY, "alpha": [1.5]}), "metrics.replay.candidate.alpha.0"),
    (heldout(candidate={**SUMMARY, "accept_length": 0.9}), "metrics.replay.candidate.accept_length"),
    (heldout(records=-1), "metrics.replay.records"),
    (heldout(skipped={"other target": -1}), "metrics.replay.skipped.other target"),
    (heldout(evidence="online"), "metrics.replay.evidence"),
    (heldout(champion_version=3), "metrics.replay.champion_version"),
    (heldout(unknown=1), "metrics.replay.unknown"),
    (heldout(greedy_records=3), "metrics.replay: Value error, greedy_records 3 > records 2"),
    (heldout(greedy_records=1), "metrics.replay: Value error, exact with greedy_records 1 of 2 records"),
    (heldout(evidence=PREQUENTIAL), "test-then-train evidence carries no samples"),
    ([1, 2], "metrics.replay: Input should be a valid dictionary"),
])
def test_a_malformed_block_is_refused_with_the_field_named(block, named):
    with pytest.raises(EvidenceError, match="^c1/head.json: ") as e:
        ReplayEvidence.from_metrics({"replay": block}, "c1/head.json")
    assert named in str(e.value) and isinstance(e.value, ValueError)


def test_from_head_meta_names_the_version_s_head_json():
    from types import SimpleNamespace

    meta = SimpleNamespace(version="c7", metrics={"replay": heldout(records="many")})
    with pytest.raises(EvidenceError, match="^c7/head.json: metrics.replay.records"):
        ReplayEvidence.from_head_meta(meta)
    assert ReplayEvidence.from_head_meta(SimpleNamespace(version="c8", metrics={})) is None


def test_the_evidence_models_import_no_torch():
    """The loop's candidate hand-off reads them without the engine; the policy may one day read them too."""
    code = ("import sys, adaptive_eagle.evidence; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'trainer', 'serving', 'policies', 'loop')); print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
