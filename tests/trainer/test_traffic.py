"""Captured traffic becomes TTT batches: captured features equal regenerated ones; prompt positions."""

import pytest
import torch

from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
from adaptive_eagle.trace import SamplingParams
from feature_store.schema import decode_record, encode_record
from tests.adaptive_eagle.test_engine import tiny_setup
from trainer.step import StepConfig, adamw, train_step
from trainer.traffic import PrefixOwners, make_traffic_batch, row_from_record, training_mask


@pytest.fixture(scope="module")
def setup():
    target, head = tiny_setup(seed=5, dtype=torch.float32)
    engine = SpeculativeEngine(target, head, EngineConfig(cost_aware=False, calibration_dir=""))
    engine.eos_ids = set()
    recs = [engine.generate(p, SamplingParams(max_tokens=20), capture=True, request_id=f"r{i}").trace
            for i, p in enumerate([[1, 2, 3, 4, 5], [7, 7, 8, 9, 10, 11, 12, 13]])]
    return target, head, recs


def test_captured_records_carry_final_hidden_states_equal_to_a_fresh_prefill(setup):
    target, _, recs = setup
    for rec in recs:
        feats = target.features(torch.tensor([rec.input_ids]))
        t = rec.aux_hidden.shape[0]
        assert rec.final_hidden.shape == (t, target.config.hidden_size)
        torch.testing.assert_close(torch.from_numpy(rec.final_hidden), feats.last[0, :t].float(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.from_numpy(rec.aux_hidden), feats.aux[0, :t].float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("codec", ["fp16", "int8b"])
def test_batches_from_captured_features_match_regenerated_ones_through_the_store(setup, codec):
    target, head, recs = setup
    stored = [decode_record(encode_record(r, codec)) for r in recs]
    assert all(r.final_hidden is not None for r in stored)
    ids = head.cfg.aux_layer_ids
    captured = make_traffic_batch(target, head, [row_from_record(r, ids) for r in stored])
    regen = make_traffic_batch(target, head, [row_from_record(r.without_hidden(), ids) for r in stored])
    assert captured.regenerated == 0 and regen.regenerated == len(recs)
    tol = 2e-3 if codec == "fp16" else 0.05
    a, b = captured.batch, regen.batch
    assert torch.equal(a.row_index, b.row_index) and torch.equal(a.input_ids, b.input_ids)
    valid = torch.arange(a.aux.shape[1])[None] < (a.lengths - 1)[:, None]  # the last position may be uncaptured
    torch.testing.assert_close(a.aux[valid], b.aux[valid], atol=tol * a.aux.abs().max().item(), rtol=0)
    assert (a.target_probs - b.target_probs).abs().sum(-1).max() < (2e-3 if codec == "fp16" else 0.05)


def test_prompt_positions_are_trained_only_when_asked(setup):
    _, head, recs = setup
    rec = recs[1]
    gen = row_from_record(rec, head.cfg.aux_layer_ids, "generated")
    every = row_from_record(rec, head.cfg.aux_layer_ids, "all")
    assert gen.loss_mask == rec.loss_mask and sum(gen.loss_mask) == 20
    assert every.loss_mask[0] == 0 and sum(every.loss_mask) == len(rec.input_ids) - 1
    with pytest.raises(ValueError, match="positions must be one of"):
        training_mask(rec, "prompt")
    short = row_from_record(rec, head.cfg.aux_layer_ids, "all", max_len=6)
    assert short.tokens == 6 and short.aux.shape[0] == 6


def test_other_aux_layers_are_regenerated_not_misread(setup):
    target, head, recs = setup
    row = row_from_record(recs[0], (0, 1, 2))
    assert not row.captured


def test_a_train_step_on_traffic_lowers_the_loss(setup):
    target, head, recs = setup
    head = head.float()
    rows = [row_from_record(r, head.cfg.aux_layer_ids, "all") for r in recs]
    batch = make_traffic_batch(target, head, rows).batch
    opt = adamw(head, 3e-3)
    losses = [train_step(head, batch, opt, None, StepConfig(max_loss_rows=None), step=i).loss for i in range(8)]
    assert losses[-1] < losses[0] * 0.9


def test_batches_carry_one_domain_tag_per_row(setup):
    target, head, recs = setup
    tagged = [recs[0].__class__(**{**recs[0].__dict__, "domain": "code"}), recs[1]]
    tb = make_traffic_batch(target, head, [row_from_record(r, head.cfg.aux_layer_ids) for r in tagged])
    assert tb.domains == ("code", None) and len(tb.domains) == tb.batch.input_ids.shape[0]


def _turns(n: int, turn: int = 50, seed: int = 0) -> list:
    """A session's records as an agent sends them: record k carries records 0..k-1's tokens, then its own."""
    from adaptive_eagle.trace import TraceRecord

    g = torch.Generator().manual_seed(seed)
    ids, out = [], []
    for k in range(n):
        ids = ids + torch.randint(1, 30, (turn,), generator=g).tolist()
        out.append(TraceRecord(request_id=f"s{seed}-t{k}", target_fingerprint="t", head_version=None,
                               backend="reference", input_ids=tuple(ids), loss_mask=(0,) * (len(ids) - 10) + (1,) * 10))
    return out


def test_new_positions_train_a_resent_session_history_once():
    owners = PrefixOwners(block=8)
    turns = _turns(4)
    masks = [training_mask(r, "new", owners) for r in turns]
    assert masks[0] == (0,) + (1,) * 49  # the first record owns all of it
    for k in range(1, 4):
        # the earlier turns' positions are context; a record trains from the block its own turn starts in
        start = (50 * k) // 8 * 8
        assert masks[k] == (0,) * start + (1,) * (50 * (k + 1) - start)
    assert [training_mask(r, "new", owners) for r in turns] == masks  # a replay trains the same positions
    # each position trains once, but for the boundary block a turn shares with the next: far fewer than "all"
    trained = sum(map(sum, masks))
    assert 199 <= trained <= 199 + 3 * 7 < sum(sum(training_mask(r, "all")) for r in turns) == 49 + 99 + 149 + 199
    # the longest record sent first owns every block: the shorter ones then train only their last, partial block
    first = PrefixOwners(block=8)
    assert sum(training_mask(turns[3], "new", first)) == 199
    assert [sum(training_mask(r, "new", first)) for r in turns[:3]] == [50 % 8, 100 % 8, 150 % 8]
    # another session shares nothing, so it trains in full
    assert sum(training_mask(_turns(1, seed=1)[0], "new", owners)) == 49


def test_new_positions_need_the_owners_and_stay_bounded():
    rec = _turns(1)[0]
    with pytest.raises(ValueError, match='positions "new" needs the PrefixOwners'):
        training_mask(rec, "new")
    with pytest.raises(ValueError, match="block 0"):
        PrefixOwners(block=0)
    owners = PrefixOwners(block=8, capacity=4)
    training_mask(rec, "new", owners, max_len=20)
    assert len(owners) == 3  # blocks within max_len only
    training_mask(_turns(1, seed=2)[0], "new", owners)
    assert len(owners) == 4  # the least recently carried blocks are evicted
    assert sum(training_mask(rec, "new", owners, max_len=20)) == 19  # evicted: owned again by the next carrier
