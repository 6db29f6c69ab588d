"""The near-line trainer on a tiny target: trains on captured traffic from a real local store, acks
only after checkpoints, survives a crash, mixes replay rows, follows the champion, writes candidates,
rides out a store outage (degraded meanwhile) and ends its loop on any other error."""

import json
import threading
import time
from types import SimpleNamespace

import torch
import pytest

from adaptive_eagle.checkpoint import HeadMeta
from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle.trace import SamplingParams
from feature_store.backend import StoreUnavailable
from feature_store.config import StoreConfig
from feature_store.reader import StoreReader
from feature_store.writer import write_records
from tests.adaptive_eagle.test_engine import tiny_setup
from trainer.config import NearlineConfig
from trainer.nearline import NearlineTrainer, candidate_latency, describe_latency, is_heldout

N_RECORDS = 24


@pytest.fixture(scope="module")
def world():
    target, head = tiny_setup(seed=11, dtype=torch.float32)
    engine = SpeculativeEngine(target, head, EngineConfig(cost_aware=False, calibration_dir=""), head_version="v1")
    engine.eos_ids = set()
    g = torch.Generator().manual_seed(0)
    records = []
    for i in range(N_RECORDS):
        prompt = torch.randint(0, 32, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        rec = engine.generate(prompt, SamplingParams(max_tokens=24), capture=True, request_id=f"req-{i}").trace
        records.append(rec.__class__(**{**rec.__dict__, "domain": "code" if i % 2 else "english"}))
    return target, head, records


def setup_run(tmp_path, world, **over):
    target, head, records = world
    reg = HeadRegistry.create(tmp_path / "registry")
    reg.register(head, HeadMeta.new("v1", target.name, target.fingerprint), dtype=torch.float32)
    reg.set_champion("v1", expect="none")
    store = StoreConfig(backend="local", local_root=str(tmp_path / "store"), fsync=False, claim_idle_ms=3_600_000)
    write_records(store, records)
    kw = dict(registry=str(tmp_path / "registry"), work_dir=str(tmp_path / "work"), store=store, batch_tokens=256,
              min_fresh_tokens=32, max_loss_rows=None, lr=1e-3, warmup_steps=0, evidence="heldout", heldout_percent=20,
              candidate_every_tokens=400, min_candidate_tokens=100, min_candidate_heldout=1, tree_depth=3, tree_topk=2,
              tree_draft_tokens=6)
    return NearlineConfig(**{**kw, **over}), target


def test_records_are_acked_only_after_the_checkpoint_that_covers_them(tmp_path, world):
    cfg, target = setup_run(tmp_path, world)
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    assert tr.poll() == N_RECORDS
    assert tr.train_once() is not None
    pending = tr.reader.stats().pending
    assert pending == N_RECORDS  # trained, not yet checkpointed: nothing acked
    tr.checkpoint()
    after = tr.reader.stats()
    assert after.pending == len(tr.fresh)  # only records not yet trained stay pending
    heldout = sum(is_heldout(r.request_id, 20) for r in world[2])
    assert sum(tr.status().heldout.values()) == heldout and 0 < heldout < N_RECORDS


def test_a_crash_loses_nothing_and_duplicates_stay_within_one_checkpoint(tmp_path, world):
    cfg, target = setup_run(tmp_path, world)
    a = NearlineTrainer(cfg, target=target)
    a.start()
    a.poll()
    a.train_once()
    a.checkpoint()
    at_checkpoint = a.counters["records_trained"]
    a.train_once(force=True)  # trained, never checkpointed: the crash comes now
    lost_step = a.counters["records_trained"] - at_checkpoint
    assert lost_step > 0
    a.reader.close()  # the process dies; its store connection goes with it

    b = NearlineTrainer(cfg, target=target)
    b.start()
    assert b.counters["records_trained"] == at_checkpoint and b.counters["steps"] == 1  # resumed
    assert b.poll() == N_RECORDS - at_checkpoint - sum(b.status().heldout.values())  # the rest, again
    while b.fresh:
        b.train_once(force=True)
    b.checkpoint()
    trained = b.counters["records_trained"]
    heldout = sum(b.status().heldout.values())
    assert trained + heldout == N_RECORDS  # every record trained or held out exactly once in the final state
    assert b.reader.stats().pending == 0 and StoreReader(cfg.store, "trainer").stats().lag == 0
    assert torch.isfinite(torch.tensor(b.loss))


def _checkpointed(tmp_path, world):
    """A trainer that trained on every record of the run (replay buffer of 4 a domain: the count cap binds, so
    keys decide what is held) and wrote its checkpoint: (cfg, target, trainer)."""
    cfg, target = setup_run(tmp_path, world, replay_per_domain=4)
    a = NearlineTrainer(cfg, target=target)
    a.start()
    a.poll()
    while a.fresh:
        a.train_once(force=True)
    a.checkpoint()
    a.reader.close()
    return cfg, target, a


def test_the_replay_buffer_resumes_with_its_keys_and_a_checkpoint_from_before_keys_still_loads(tmp_path, world):
    cfg, target, a = _checkpointed(tmp_path, world)
    b = NearlineTrainer(cfg, target=target)
    b.start()
    assert b.buffer.items() == a.buffer.items() and b.buffer.priorities() == a.buffer.priorities()
    assert b.buffer.seen() == a.buffer.seen() and max(a.buffer.seen().values()) > 4
    b.reader.close()
    meta_file = tmp_path / "work" / "state" / "trainer.json"
    meta = json.loads(meta_file.read_text())
    del meta["buffer_priorities"]
    meta_file.write_text(json.dumps(meta))
    old = NearlineTrainer(cfg, target=target)
    old.start()
    assert sorted(old.buffer.items()) == sorted(a.buffer.items()) and old.buffer.seen() == a.buffer.seen()
    assert old.counters["steps"] == a.counters["steps"]
    old.reader.close()


def test_a_checkpoint_whose_replay_buffer_is_refused_starts_from_the_champion_instead_of_crash_looping(tmp_path,
                                                                                                    world):
    """A refused buffer raised out of start(): the actor's loop died, Ray restarted it into the same error for
    good (a cluster run's trainer did so). Now the checkpoint is refused with its reason, nothing of it kept."""
    cfg, target, a = _checkpointed(tmp_path, world)
    meta_file = tmp_path / "work" / "state" / "trainer.json"
    meta = json.loads(meta_file.read_text())
    meta["buffer_priorities"]["keys"][0] = 2.0  # corrupt: outside [0, 1)
    meta_file.write_text(json.dumps(meta))
    b = NearlineTrainer(cfg, target=target)
    b.start()  # raised ValueError before
    assert any("refused" in e and "outside [0, 1)" in e for e in b.events), b.events
    assert b.counters["steps"] == 0 and len(b.buffer) == 0 and b.base == a.base
    b.reader.close()


def test_every_batch_keeps_the_replay_ratio(tmp_path, world):
    # records of 28-36 tokens: the fresh half (80 padded tokens) takes two, and two replayed ones beside them
    # keep the padded batch within batch_tokens (4 x 36 <= 160), so the ratio holds exactly
    cfg, target = setup_run(tmp_path, world, replay_ratio=0.5, batch_tokens=160)
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    tr.poll()
    tr.train_once(force=True)  # the first batch: nothing to replay yet
    compositions = []
    while tr.fresh:
        tr.train_once(force=True)
        compositions.append(tr.last_batch)
    assert compositions and all(c["replay"] == c["fresh"] for c in compositions)


def test_rows_too_long_to_share_a_batch_still_get_their_replay_share(tmp_path, world):
    """A long session fills a batch alone, so no replay row fits beside it: the replay share is owed and paid by
    steps on replay alone, and earlier traffic is still replayed at replay_ratio of the rows."""
    cfg, target = setup_run(tmp_path, world, replay_ratio=0.5, batch_tokens=64, min_fresh_tokens=1)  # rows 28-36
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    tr.poll()
    fresh_rows, kinds = 0, []
    while tr.fresh:
        kinds.append(tr.ready())
        tr.train_once(force=True)
        fresh_rows += tr.last_batch["fresh"]
        assert tr.last_batch["fresh"] <= 1  # the fresh half of a batch holds one row
    assert "owed" in kinds and tr.status().rows_replayed == tr.counters["rows_replayed"]
    # every fresh row after the first (nothing to replay yet) owes one replay row at ratio 0.5; a replay step
    # fills its batch, so it may pay more than it owed
    assert fresh_rows - 2 <= tr.counters["rows_replayed"] <= 2 * fresh_rows
    assert tr.intake.replay_owed < 1


def test_a_long_replay_record_is_left_out_rather_than_pad_a_batch_past_batch_tokens(tmp_path, world):
    """Every row pads to the batch's longest: a long session drawn for replay beside short fresh rows would
    pad them all to its length (8k tokens each at the default max_len). It waits in the buffer instead."""
    cfg, target = setup_run(tmp_path, world, batch_tokens=128)
    tr = NearlineTrainer(cfg, target=target)

    def rec(n):
        return SimpleNamespace(input_ids=(1,) * n)

    tr.intake.replay = lambda n: [rec(100), rec(30), rec(40)][:n]
    got = tr.intake.replay_beside([rec(30), rec(30)], 3)  # 100: 3 rows x 100 > 128; 30: 3 x 30; 40: 4 x 40 > 128
    assert [len(r.input_ids) for r in got] == [30]
    assert tr.intake.replay_beside([rec(20)], 1) == []  # 2 rows x 100 > 128
    assert [len(r.input_ids) for r in tr.intake.replay_beside([rec(20)], 2)] == [30]
    capped = NearlineTrainer(cfg.model_copy(update={"max_len": 64}), target=target)
    capped.intake.replay = tr.intake.replay
    assert [len(r.input_ids) for r in capped.intake.replay_beside([rec(20)], 1)] == [100]  # cut to 64: 2 x 64 fits


def test_records_cut_before_their_first_generated_token_are_counted_and_not_trained(tmp_path, world):
    """A prompt longer than max_len leaves a row with nothing to train on: it is left out of the batch, counted
    under skipped, and not kept for replay; a batch of only such rows is consumed without an update."""
    target, head, records = world
    engine = SpeculativeEngine(target, head, EngineConfig(cost_aware=False, calibration_dir=""), head_version="v1")
    engine.eos_ids = set()
    long = [engine.generate([(i + k) % 30 + 1 for k in range(20)], SamplingParams(max_tokens=8), capture=True,
                            request_id=f"long-{i}").trace for i in range(4)]
    cfg, target = setup_run(tmp_path, (target, head, long + records[:6]), max_len=16, heldout_percent=1)
    kept = [r for r in long if not is_heldout(r.request_id, cfg.heldout_percent)]
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    tr.poll()
    before = [p.detach().clone() for p in tr.head.parameters()]
    tr.train_once(force=True)  # the first batch holds long records only (batch_tokens 256 > 4 x 16)
    while tr.fresh:
        tr.train_once(force=True)
    assert tr.counters["skipped"]["no_trained_position_within_max_len"] == len(kept) > 0
    assert len(tr.buffer) == tr.counters["records_trained"] - len(kept)
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.head.parameters()))  # the short ones trained


def test_a_batch_with_nothing_to_train_on_counts_no_step_and_no_replay_row(tmp_path, world):
    """Only prompts longer than max_len: every batch is consumed, nothing is learned, and neither a step nor a
    replay row is counted (the status would otherwise show training that never happened)."""
    target, head, _ = world
    engine = SpeculativeEngine(target, head, EngineConfig(cost_aware=False, calibration_dir=""), head_version="v1")
    engine.eos_ids = set()
    long = [engine.generate([(i + k) % 30 + 1 for k in range(20)], SamplingParams(max_tokens=8), capture=True,
                            request_id=f"long-{i}").trace for i in range(4)]
    cfg, target = setup_run(tmp_path, (target, head, long), max_len=16, heldout_percent=1)
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    tr.poll()
    before = [p.detach().clone() for p in tr.head.parameters()]
    while tr.fresh:
        assert tr.train_once(force=True) is None
    assert tr.counters["steps"] == 0 and tr.counters["rows_replayed"] == 0 and tr.counters["tokens_trained"] == 0
    assert tr.counters["skipped"]["no_trained_position_within_max_len"] > 0
    assert all(torch.equal(a, b) for a, b in zip(before, tr.head.parameters()))


def test_new_positions_skip_a_record_whose_every_position_an_earlier_one_carried(tmp_path, world):
    target, head, records = world
    engine = SpeculativeEngine(target, head, EngineConfig(cost_aware=False, calibration_dir=""), head_version="v1")
    engine.eos_ids = set()
    first = engine.generate([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=24), capture=True, request_id="t0").trace
    # a turn that resends the first one's whole record and adds its own, then a retry of the first request
    second = engine.generate(list(first.input_ids) + [7, 7, 7], SamplingParams(max_tokens=8), capture=True,
                             request_id="t1").trace
    retry = first.__class__(**{**first.__dict__, "request_id": "t0-retry"})
    cfg, target = setup_run(tmp_path, (target, head, [first, second, retry]), positions="new", heldout_percent=1,
                            min_fresh_tokens=1)
    assert not any(is_heldout(r.request_id, 1) for r in (first, second, retry))
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    tr.poll()
    while tr.fresh:
        tr.train_once(force=True)
    assert tr.counters["skipped"] == {"no_new_position_within_max_len": 1}  # the retry: nothing new in it
    assert len(tr.buffer) == 2  # and it is not replayed


def test_idle_trainer_makes_more_passes_over_the_buffer_up_to_its_budget(tmp_path, world):
    cfg, target = setup_run(tmp_path, world, max_passes=2.0)
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    tr.poll()
    while tr.fresh:
        tr.train_once(force=True)
    once = tr.counters["tokens_trained"]
    while tr.train_once() is not None:
        pass
    assert tr.last_batch["fresh"] == 0
    assert once < tr.counters["tokens_trained"] <= 2.0 * tr.counters["tokens_received"] + cfg.batch_tokens


def test_no_candidate_before_the_gate_has_enough_heldout_records_to_judge_it(tmp_path, world):
    heldout = sum(is_heldout(r.request_id, 20) for r in world[2])
    cfg, target = setup_run(tmp_path, world, min_candidate_heldout=heldout + 1)
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    tr.poll()
    while tr.fresh:
        tr.train_once(force=True)
    assert tr.counters["tokens_trained"] >= cfg.candidate_every_tokens and not tr.candidate_due()
    tr.heldout["code"].append(world[2][0])  # one more held-out record: now the gate can judge a candidate
    assert tr.candidate_due()


def test_candidate_carries_replay_scores_next_to_the_champion_and_the_trainer_follows_a_promotion(tmp_path, world):
    cfg, target = setup_run(tmp_path, world)
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    tr.poll()
    while tr.fresh:
        tr.train_once(force=True)
    assert tr.candidate_due()
    name = tr.write_candidate()
    v = tr.registry.version(name)
    assert v.parent == "v1" and v.training["trainer"] == "nearline"
    replay = v.metrics["replay"]
    n = replay["records"]
    assert n == sum(tr.status().heldout.values()) and n > 0
    assert len(replay["samples"]["candidate"]) == len(replay["samples"]["champion"]) > 0
    assert [s[0] for s in replay["samples"]["candidate"]] == [s[0] for s in replay["samples"]["champion"]]
    assert replay["exact"] and replay["greedy_records"] == n  # greedy traffic: the replay is exact
    lat = v.data["latency_s"]  # every fresh record trained so far is new in this candidate
    assert lat["records"] == tr.counters["records_trained"] > 0 and tr.status().candidate_latency == lat
    assert 0 <= lat["capture_to_candidate_min"] <= lat["capture_to_candidate_p50"] <= lat["capture_to_candidate_max"]
    assert set(lat["stages_p50"]) == {"capture_to_trainer", "queued", "trained_to_evaluation", "evaluation"}
    assert "new records were captured" in tr.events[-1]
    tr.registry.set_champion(name, expect="v1")
    steps, head = tr.counters["steps"], tr.head
    assert tr.follow_champion() and tr.base == name and tr.counters["steps"] == steps and tr.head is head


def test_a_promoted_snapshot_of_the_line_keeps_the_line_and_a_rollback_restarts(tmp_path, world):
    """A promotion of the trainer's own snapshot keeps what the line learnt after it (in three continual runs the
    trainer threw away 15-18 minutes of training at each promotion and wrote its next snapshot 15 minutes
    later); the next snapshot is due at once and is judged against the new champion. A rollback to a head the
    line did not write restarts from it."""
    cfg, target = setup_run(tmp_path, world, evidence="prequential", candidate_every_minutes=60.0,
                            candidate_every_tokens=10**9)
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    tr.poll()
    half = len(tr.fresh) // 2
    while len(tr.fresh) > half:
        tr.train_once(force=True)
    snap = tr.write_candidate()
    while tr.fresh:
        tr.train_once(force=True)
    assert not tr.candidate_due()  # trained past snap, but 60 minutes to the next one
    steps = tr.counters["steps"]
    line = {k: v.clone() for k, v in tr.head.state_dict().items()}
    promoted = tr.registry.load(snap, target).head.state_dict()
    assert any(not torch.equal(line[k].to(promoted[k].dtype), promoted[k]) for k in line)  # it learnt past snap
    tr.registry.set_champion(snap, expect="v1")
    assert tr.follow_champion() and tr.base == snap
    assert tr.counters["steps"] == steps and all(torch.equal(line[k], v) for k, v in tr.head.state_dict().items())
    assert all(torch.equal(promoted[k].float(), v) for k, v in tr.champion_head.state_dict().items())
    assert "a snapshot of this trainer's line" in tr.events[-1] and not tr.book.open
    assert tr.candidate_due()  # the line's steps since snap are untested
    nxt = tr.write_candidate()
    assert tr.registry.version(nxt).parent == snap
    tr.registry.set_champion("v1", expect=snap)  # a rollback: v1 is not a snapshot of this line
    assert tr.follow_champion() and tr.base == "v1" and tr.counters["steps"] == 0
    v1 = tr.registry.load("v1", target).head.state_dict()
    assert all(torch.equal(v1[k].float(), v) for k, v in tr.head.state_dict().items())


def test_test_then_train_snapshots_gather_evidence_only_from_records_they_never_trained_on(tmp_path, world):
    """Evidence 'prequential': no record is held out; a snapshot is written without replay, and every record the
    trainer takes afterwards is replayed by the champion and the snapshot before a step trains on it. The
    evidence file holds exactly those records, in arrival order; a newer snapshot beyond max_pending closes the
    oldest's file, and a champion change closes the rest."""
    from adaptive_eagle.evidence import read_evidence

    target, head, records = world
    cfg, target = setup_run(tmp_path, world, evidence="prequential", max_pending_candidates=1)
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    tr.poll()
    assert not tr.heldout and len(tr.fresh) == N_RECORDS  # nothing withheld
    half = N_RECORDS // 2
    trained_before = []
    while len(trained_before) < half:
        before = {r.request_id for _, r in tr.fresh}
        tr.train_once(force=True)
        trained_before += sorted(before - {r.request_id for _, r in tr.fresh})
    assert tr.candidate_due()
    first = tr.write_candidate()
    v = tr.registry.version(first)
    assert v.metrics["replay"] == {"evidence": "prequential", "champion_version": "v1", "tree": cfg.tree.__dict__,
                                   "records": 0}
    ev = read_evidence(cfg.registry, first)
    assert ev.open and ev.rows == [] and ev.champion == "v1"
    waiting = [r.request_id for _, r in tr.fresh]
    while tr.fresh:
        tr.train_once(force=True)
    ev = read_evidence(cfg.registry, first)
    assert [r[0] for r in ev.rows] == waiting  # the records it never trained on, in arrival order
    assert not set(waiting) & set(trained_before)
    assert ev.exact and all(r[2] >= 1 and r[3] >= 1 for r in ev.rows)
    assert tr.status().gathering[0]["records"] == len(waiting) and tr.status().evidence == "prequential"
    second = tr.write_candidate()  # max_pending 1: the first snapshot's evidence closes
    closed = read_evidence(cfg.registry, first)
    assert not closed.open and "superseded" in closed.closed_reason and len(closed.rows) == len(waiting)
    assert read_evidence(cfg.registry, second).open
    tr.registry.set_champion(second, expect="v1")
    assert tr.follow_champion()
    assert "champion changed" in read_evidence(cfg.registry, second).closed_reason and not tr.book.open


def test_a_restarted_trainer_closes_the_evidence_it_left_open(tmp_path, world):
    from adaptive_eagle.evidence import read_evidence

    cfg, target = setup_run(tmp_path, world, evidence="prequential")
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    tr.poll()
    while tr.counters["tokens_trained"] < cfg.min_candidate_tokens:
        tr.train_once(force=True)
    name = tr.write_candidate()
    tr.checkpoint()
    assert read_evidence(cfg.registry, name).open
    again = NearlineTrainer(cfg, target=target)
    again.start()
    ev = read_evidence(cfg.registry, name)
    assert not ev.open and "restarted" in ev.closed_reason


def test_records_that_wait_too_long_for_a_step_go_to_the_replay_buffer(tmp_path, world):
    """A trainer behind the traffic trains on recent records: one that waited past max_fresh_age_s goes into the
    replay buffer (counted, acked with the next checkpoint), so the fresh queue stays bounded."""
    cfg, target = setup_run(tmp_path, world, max_fresh_age_s=0.05)
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    tr.poll()
    fresh = len(tr.fresh)
    assert fresh > 0
    time.sleep(0.1)
    assert tr.train_once() is not None  # a replay step: nothing fresh is left to train on
    assert not tr.fresh and tr.counters["records_trained"] == 0
    assert tr.status().aged_to_replay == fresh == len(tr.buffer) and len(tr.done_ids) >= fresh


def test_trainer_latency_splits_capture_to_candidate_into_its_stages():
    # (captured, read, trained) for three records; evaluation from 100 to 130
    lat = candidate_latency([(0.0, 2.0, 10.0), (20.0, 21.0, 50.0), (40.0, 44.0, 60.0)], 100.0, 130.0)
    assert (lat["records"], lat["capture_to_candidate_min"], lat["capture_to_candidate_p50"],
            lat["capture_to_candidate_max"]) == (3, 90.0, 110.0, 130.0)
    assert lat["stages_p50"] == {"capture_to_trainer": 2.0, "queued": 16.0, "trained_to_evaluation": 50.0,
                                 "evaluation": 30.0}
    assert candidate_latency([], 0.0, 1.0) is None
    assert "median 110 s: 2 s to the trainer, 16 s queued, 50 s to the candidate's evaluation" in \
        describe_latency(lat)


def test_records_of_another_target_are_refused_and_counted(tmp_path, world):
    cfg, target = setup_run(tmp_path, world)
    other = world[2][0].__class__(**{**world[2][0].__dict__, "target_fingerprint": "f" * 64, "request_id": "x"})
    write_records(cfg.store, [other])
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    tr.poll()
    assert tr.status().skipped == {"other target": 1}


def test_cold_start_builds_a_head_from_the_traffic_when_the_champion_is_plain(tmp_path, world):
    cfg, target = setup_run(tmp_path, world, cold_start_records=8)
    HeadRegistry(cfg.registry).set_champion("none", expect="v1")
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    assert tr.head is None and tr.base == "none"
    tr.poll()
    assert tr.train_once(force=True) is not None and tr.head is not None
    assert any("cold start" in e for e in tr.events)


def test_the_trainer_yields_to_queued_requests_but_never_starves(tmp_path, world):
    cfg, target = setup_run(tmp_path, world, max_yield_s=0.3, poll_ms=20)
    busy = {"on": True}
    tr = NearlineTrainer(cfg, target=target, yield_to=lambda: busy["on"])
    tr.start()
    tr.tick()
    assert tr.counters["steps"] == 0 and tr.state == "waiting"  # requests queue: it waits ...
    import time

    deadline = time.monotonic() + 20
    while tr.counters["steps"] == 0 and time.monotonic() < deadline:
        tr.tick()
    assert tr.counters["steps"] == 1  # ... but not longer than max_yield_s at a stretch
    tr.tick()
    assert tr.counters["steps"] == 1  # then it yields again
    busy["on"] = False
    tr.tick()
    assert tr.counters["steps"] == 2


# ---- faults: a store outage is ridden out, anything else ends the loop ---------------------------
class FlakyReader:
    """A StoreReader whose store is down (StoreUnavailable on read and/or ack) until `heal` is set."""

    def __init__(self, inner: StoreReader, heal: threading.Event, read: bool = True, ack: bool = True):
        self.inner, self.heal, self.fail_read, self.fail_ack = inner, heal, read, ack
        self.failures = 0

    def _down(self, what: str) -> None:
        if not self.heal.is_set():
            self.failures += 1
            raise StoreUnavailable(f"redis {what} failed: Connection refused")

    def read(self, *args, **kw):
        if self.fail_read:
            self._down("read")
        return self.inner.read(*args, **kw)

    def ack(self, ids) -> None:
        if self.fail_ack:
            self._down("ack")
        self.inner.ack(ids)

    def stats(self):
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


def flaky_trainer(tmp_path, world, heal, read=True, ack=True, **over):
    fast = dict(poll_ms=20, checkpoint_every_s=0.2, store_backoff_initial_s=0.01, store_backoff_max_s=0.05)
    cfg, target = setup_run(tmp_path, world, **{**fast, **over})
    reader = FlakyReader(StoreReader(cfg.store, cfg.group, cfg.consumer), heal, read, ack)
    return NearlineTrainer(cfg, target=target, reader=reader), reader


def wait_for(condition, deadline_s: float = 120.0) -> None:
    """Poll `condition` until it holds (a generous deadline: the verdict never depends on speed)."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.02)


def test_a_store_outage_is_ridden_out_and_the_status_says_degraded_meanwhile(tmp_path, world):
    heal, stop = threading.Event(), threading.Event()
    tr, reader = flaky_trainer(tmp_path, world, heal)
    loop = threading.Thread(target=tr.run, args=(stop,), daemon=True)
    loop.start()
    try:
        wait_for(lambda: tr.errors_total >= 3)  # the store is down: the loop backs off and tries again
        state = tr.state
        assert state.startswith("degraded since ") and state.endswith(
            "Z: StoreUnavailable: redis read failed: Connection refused"), state
        assert tr.counters["steps"] == 0 and tr.last_step_at is None and loop.is_alive()
        heal.set()  # the store answers again
        wait_for(lambda: tr.counters["steps"] >= 1)
        wait_for(lambda: not tr.state.startswith("degraded"))
    finally:
        stop.set()
        loop.join(120)
    status = tr.status()
    assert not loop.is_alive() and status.state == "stopped" and status.steps >= 1
    assert status.errors_total == reader.failures >= 3 and status.last_error.startswith("StoreUnavailable")
    assert status.last_step_at is not None and status.last_step_at <= time.time()
    assert any("store error, retrying" in e for e in tr.events) and any("store answers again" in e for e in tr.events)
    assert reader.stats().pending == len(tr.fresh)  # everything trained or held out was acked in the end


def test_a_failed_ack_keeps_its_records_for_the_next_checkpoint(tmp_path, world):
    heal = threading.Event()
    tr, reader = flaky_trainer(tmp_path, world, heal, read=False)
    tr.start()
    tr.poll()
    assert tr.train_once() is not None
    owed = list(tr.done_ids)
    with pytest.raises(StoreUnavailable):
        tr.checkpoint()  # the state is written, the ack fails
    assert tr.done_ids == owed and reader.stats().pending == N_RECORDS
    heal.set()
    tr.checkpoint()
    assert tr.done_ids == [] and reader.stats().pending == len(tr.fresh)


def test_the_loop_gives_up_after_store_max_errors_in_a_row(tmp_path, world):
    tr, reader = flaky_trainer(tmp_path, world, threading.Event(), store_max_errors=3)
    with pytest.raises(RuntimeError, match="the store failed 4 times in a row since .*Z; last: StoreUnavailable"):
        tr.run(budget_s=600)
    assert tr.state.startswith("error: RuntimeError: the store failed 4 times") and tr.errors_total == 4


def test_an_error_that_is_not_the_stores_ends_the_loop(tmp_path, world):
    cfg, target = setup_run(tmp_path, world)
    tr = NearlineTrainer(cfg, target=target)
    tr.reader.read = lambda *a, **kw: (_ for _ in ()).throw(ValueError("schema MAJOR 9"))
    with pytest.raises(ValueError, match="schema MAJOR 9"):
        tr.run(budget_s=600)
    status = tr.status()
    assert status.state == "error: ValueError: schema MAJOR 9" and status.errors_total == 1
    assert status.last_error == "ValueError: schema MAJOR 9"
