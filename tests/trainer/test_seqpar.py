"""Sequence-parallel TTT (trainer/seqpar.py): W ranks, each holding a position shard of the rows, compute the
single-process `ttt_loss` together. Real processes (torch.multiprocessing, a gloo group), tiny float64 model.

Exactness. `ttt_loss` keeps its cross-entropy statistics in float32 (SoftCrossEntropy), and W ranks each take
the mean over their own rows (scaled by their share) where one process takes one mean: the production loss
agrees to float32 rounding (~1e-7 relative). Everything else (the ring, the shards and their halo, the scored
positions, the merges) is checked exactly by swapping in a float64 cross-entropy on both sides: then loss and
every gradient agree to ~1e-12.
"""

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.trainer.test_ttt import make_batch, make_setup
from trainer import ttt
from trainer.seqpar import (Ring, RingAttention, all_reduce_gradients, seqpar_ttt_loss, shard_batch, shard_rows,
                            split_positions)
from trainer.ttt import TTTBatch, ttt_loss

STEPS = 7


class ExactSoftCrossEntropy(torch.autograd.Function):
    """SoftCrossEntropy in the logits' own dtype (float64 here): the reference for exactness checks."""

    @staticmethod
    def forward(ctx, z, p):
        lse = torch.logsumexp(z, dim=-1)
        ctx.save_for_backward(z, p, lse)
        return (lse - (p * z).sum(-1)).mean()

    @staticmethod
    def backward(ctx, grad):
        z, p, lse = ctx.saved_tensors
        return (torch.exp(z - lse[:, None]) - p) * (grad / z.shape[0]), None


def masked_batch(target, head, lengths, mask, seed=0):
    """A batch with the given row lengths and loss mask [B, T] (the target's distribution and argmax exact)."""
    g = torch.Generator().manual_seed(seed)
    b, t = mask.shape
    ids = torch.randint(3, target.config.vocab_size, (b, t), generator=g)
    lengths = torch.tensor(lengths)
    feats = target.features(ids, (torch.arange(t)[None] < lengths[:, None]).long())
    w = target.output_embeddings()[head.draft_to_target]
    full = feats.last @ target.output_embeddings().T
    return TTTBatch.build(ids, mask.long(), lengths, feats.aux, lambda need: feats.last[need] @ w.T, full.argmax(-1))


def traffic_rows(target, n, seed=0):
    """n traffic rows of different lengths; the even ones carry captured features, the odd ones are regenerated."""
    from trainer.traffic import TrafficRow

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        t = 12 + 5 * i
        ids = torch.randint(3, target.config.vocab_size, (1, t), generator=g)
        mask = (torch.rand(t, generator=g) < 0.7).long()
        mask[0] = 0
        aux = final = None
        if i % 2 == 0:
            feats = target.features(ids, torch.ones_like(ids))
            aux, final = feats.aux[0].float(), feats.last[0].float()
        rows.append(TrafficRow(f"req-{i}", None, tuple(ids[0].tolist()), tuple(mask.tolist()), aux, final))
    return rows


def prompt_heavy(target, head):
    """No loss before position 18: with 4 ranks (owning 0-7, ...) rank 0 scores no chain at all."""
    mask = (torch.rand(2, 29, generator=torch.Generator().manual_seed(4)) < 0.8).long()
    mask[:, :18] = 0
    return masked_batch(target, head, [29, 23], mask, seed=4)


def edge_batch(target, head):
    """Shard edges on loss-mask edges (4 ranks own 0-7, 8-14, 15-21, 22-28: the mask turns on or off at 8, 15
    and 22), a row ending inside shard 2 and a row ending exactly at shard 3's start."""
    mask = torch.zeros(3, 29, dtype=torch.long)
    mask[:, 8:15] = 1
    mask[:, 22:] = 1
    mask[1, 15:17] = 1
    return masked_batch(target, head, [29, 18, 22], mask, seed=5)


# name: (ranks, batch, max_loss_rows, attention chunk, exact cross-entropy)
CASES = {
    "w2": (2, "random", None, 1024, True),
    "w3": (3, "random", None, 4, True),
    "w4": (4, "random", None, 3, True),
    "w3-sampled": (3, "random", 12, 5, True),
    "w4-prompt": (4, "prompt", None, 4, True),
    "w4-edges": (4, "edges", None, 2, True),
    "w4-empty-shard": (4, "short", None, 4, True),
    "w2-production-ce": (2, "random", None, 7, False),
}
WORLD = 4
SAMPLE_SEED = 5


def batches(target, head):
    short = torch.tensor([[0, 1, 1]])  # 3 positions over 4 ranks: rank 3 owns none
    return {"random": make_batch(target, head, b=3, t=29), "prompt": prompt_heavy(target, head),
            "edges": edge_batch(target, head), "short": masked_batch(target, head, [3], short, seed=6)}


def _rank_main(rank, init_file, head, data, out_dir):
    """One rank: every case, in order (a case on fewer ranks runs on a subgroup; the others skip it)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    groups = {w: dist.new_group(list(range(w))) for w in (2, 3)}
    groups[WORLD] = None
    results = {}
    original = ttt.SoftCrossEntropy  # trainer.ttt.score_step, which both loss paths call, looks it up there
    try:
        for name, (world, which, max_rows, chunk, exact) in CASES.items():
            if rank >= world:
                continue
            ttt.SoftCrossEntropy = ExactSoftCrossEntropy if exact else original
            head.zero_grad(set_to_none=True)
            shard = shard_batch(data[which], rank, world, halo=STEPS)
            ring = Ring(shard.bounds, groups[world])
            gen = torch.Generator().manual_seed(SAMPLE_SEED) if max_rows else None
            out = seqpar_ttt_loss(head, shard, ring, steps=STEPS, max_loss_rows=max_rows, generator=gen,
                                  attention_chunk=chunk)
            out.objective().backward()
            params = [p for p in head.parameters() if p.requires_grad]
            all_reduce_gradients(params, groups[world])
            o = out.ttt
            results[name] = {"local": float(out.local_loss.detach()), "loss": out.loss,
                             "grads": [None if p.grad is None else p.grad.clone() for p in params],
                             "shifts": ring.shifts, "peers": sorted(ring.peers), "sent": ring.elements_sent,
                             "stats": (o.step_loss, o.step_count, o.step_correct, o.step_accept, o.step_eligible),
                             "rows": int(o.row_position.numel())}
    finally:
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks_and_reference(tmp_path_factory):
    """Every case on real ranks (one spawn of 4 processes), and the single-process reference of each."""
    target, head = make_setup(dtype=torch.float64)
    data = batches(target, head)
    d = tmp_path_factory.mktemp("seqpar")
    t0 = time.time()
    mp.spawn(_rank_main, args=(str(d / "init"), head, data, str(d)), nprocs=WORLD, join=True)
    spawn_s = time.time() - t0
    got = [torch.load(d / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]  # tensors and plain data only
    params = [p for p in head.parameters() if p.requires_grad]
    want = {}
    original = ttt.SoftCrossEntropy
    try:
        for name, (world, which, max_rows, chunk, exact) in CASES.items():
            ttt.SoftCrossEntropy = ExactSoftCrossEntropy if exact else original
            gen = torch.Generator().manual_seed(SAMPLE_SEED) if max_rows else None
            out = ttt_loss(head, data[which], steps=STEPS, max_loss_rows=max_rows, generator=gen, attention_chunk=None)
            grads = torch.autograd.grad(out.loss, params, allow_unused=True)
            want[name] = (out, grads)
    finally:
        ttt.SoftCrossEntropy = original
    return got, want, spawn_s


def max_rel(got, want) -> float:
    """Largest gradient difference over all parameters, relative to the largest gradient entry (a parameter
    whose true gradient is 0 holds rounding noise of ~1e-18, which no per-tensor relative bound survives)."""
    scale = max(float(w.abs().max()) for w in want if w is not None)
    return max(float((g - w).abs().max()) for g, w in zip(got, want) if w is not None) / scale


@pytest.mark.parametrize("name", list(CASES))
def test_ranks_together_equal_one_process(ranks_and_reference, name):
    got, want, _ = ranks_and_reference
    world, _, _, _, exact = CASES[name]
    ref, ref_grads = want[name]
    tol = 1e-11 if exact else 2e-6
    parts = [got[r][name] for r in range(world)]
    ref_loss = float(ref.loss.detach())
    # the ranks' shares sum to the loss; every rank knows the whole loss and statistics
    assert sum(p["local"] for p in parts) == pytest.approx(ref_loss, rel=tol)
    for p in parts:
        assert p["loss"] == pytest.approx(ref_loss, rel=tol)
        loss, count, correct, accept, eligible = p["stats"]
        assert count == ref.step_count and correct == ref.step_correct
        assert accept == ref.step_accept and eligible == ref.step_eligible
        assert loss == pytest.approx(ref.step_loss, rel=tol if exact else 1e-5)
        # after the all-reduce every rank holds the single-process gradient
        assert [g is None for g in p["grads"]] == [w is None for w in ref_grads]
        assert max_rel(p["grads"], ref_grads) < (1e-10 if exact else 1e-6), name
    assert sum(p["rows"] for p in parts) == int(ref.row_position.numel())


def test_blocks_travel_by_ring_between_neighbours_only(ranks_and_reference):
    got, _, _ = ranks_and_reference
    for name, (world, *_rest) in CASES.items():
        for r in range(world):
            p = got[r][name]
            # per TTT step: W-1 forward rounds, W-1 backward rounds and one hop home
            assert p["shifts"] == STEPS * (world - 1) + STEPS * world, name
            assert set(p["peers"]) <= {(r + 1) % world, (r - 1) % world} and p["peers"], name
    assert all(got[r]["w4"]["sent"] > 0 for r in range(WORLD))


def test_a_shard_without_chains_and_an_empty_shard_still_train(ranks_and_reference):
    got, _, _ = ranks_and_reference
    assert got[0]["w4-prompt"]["rows"] == 0 and got[3]["w4-prompt"]["rows"] > 0
    empty = got[3]["w4-empty-shard"]  # owns no position: scores nothing, still passes its neighbours' blocks on
    assert empty["rows"] == 0 and empty["sent"] > 0 and set(empty["peers"]) == {0, 2}


def test_shards_own_contiguous_positions_and_carry_a_halo():
    assert split_positions(29, 3) == ((0, 10), (10, 20), (20, 29))
    assert split_positions(3, 4) == ((0, 1), (1, 2), (2, 3), (3, 3))
    target, head = make_setup(dtype=torch.float64)
    batch = make_batch(target, head, b=3, t=29)
    s1 = shard_batch(batch, 1, 3, halo=STEPS)
    assert (s1.start, s1.end, s1.halo) == (10, 20, STEPS)
    assert s1.window.aux.shape[1] == 10 and s1.window.input_ids.shape[1] == 10 + STEPS
    assert torch.equal(s1.window.lengths, torch.tensor([10, 10, 10]))  # rows of length 29, 24, 20
    assert shard_batch(batch, 2, 3).halo == 0  # the last shard: nothing past the rows' end
    used = s1.window.row_index >= 0  # target rows re-indexed into the window's own table
    assert torch.equal(s1.window.target_probs[s1.window.row_index[used]],
                       batch.target_probs[batch.row_index[:, 10 : 10 + STEPS + 10][used]])
    assert sum(int(shard_batch(batch, r, 3).window.lengths.sum()) for r in range(3)) == int(batch.lengths.sum())
    with pytest.raises(ValueError, match="rank 3 must be in"):
        shard_batch(batch, 3, 3)


def test_a_traffic_shard_equals_the_shard_of_the_whole_traffic_batch():
    from trainer.traffic import make_traffic_batch

    target, head = make_setup(dtype=torch.float32)
    rows = traffic_rows(target, 4)
    whole = make_traffic_batch(target, head, rows, "cpu").batch
    for rank in range(3):
        got, regenerated = shard_rows(target, head, rows, rank, 3, halo=STEPS, device="cpu")
        want = shard_batch(whole, rank, 3, halo=STEPS)
        assert got.bounds == want.bounds and regenerated == 2  # every rank regenerates the uncaptured rows
        for f in dataclasses.fields(TTTBatch):
            a, b = getattr(got.window, f.name), getattr(want.window, f.name)
            assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-6, atol=1e-7), f.name


@pytest.fixture
def one_rank(tmp_path):
    """A one-process gloo group in this process (for checks that need a ring but no peers)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_rank_is_the_plain_loss_and_bad_inputs_are_refused(one_rank):
    target, head = make_setup(dtype=torch.float64)
    batch = make_batch(target, head, b=2, t=20)
    shard = shard_batch(batch, 0, 1)
    ring = Ring(shard.bounds)
    out = seqpar_ttt_loss(head, shard, ring, steps=5, attention_chunk=6)
    want = ttt_loss(head, batch, steps=5, attention_chunk=None)
    assert out.loss == pytest.approx(float(want.loss.detach()), rel=1e-6) and ring.shifts == 0
    with pytest.raises(ValueError, match="shard halo 2 must be >= steps 5"):  # checked before any exchange
        seqpar_ttt_loss(head, shard_batch(batch, 0, 2, halo=2), ring, steps=5)
    with pytest.raises(ValueError, match="shard of rank 0 with bounds"):
        seqpar_ttt_loss(head, shard_batch(batch, 0, 2), ring, steps=5)
    with pytest.raises(ValueError, match="bounds has 2 shards, the process group 1 ranks"):
        Ring(((0, 10), (10, 20)))
    _, moe = make_setup(dtype=torch.float64, num_experts=2)
    with pytest.raises(ValueError, match="num_experts 2: sequence parallel needs a dense head"):
        seqpar_ttt_loss(moe, shard, ring)


def test_ring_attention_on_one_rank_is_block_attention_with_gradients(one_rank):
    from tests.trainer.test_long_attention import dense_reference, inputs

    q, k, v, q_pos, _ = inputs(h=4, kvh=2, n=9, s=9)
    q_pos = torch.arange(9)
    ring = Ring(((0, 9),))
    out, lse = RingAttention.apply(q, k[None], v[None], q_pos, [9], ring, 4, q.shape[-1] ** -0.5)
    w_out, w_lse = dense_reference(q, k, v, q_pos, torch.arange(9))
    torch.testing.assert_close(out, w_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, w_lse, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad((out.sin().sum() + lse.cos().sum()), (q, k, v))
    w = torch.autograd.grad((w_out.sin().sum() + w_lse.cos().sum()), (q, k, v))
    for a, b in zip(g, w):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_sequence_parallel_step_on_ray_train_workers_equals_one_in_process_step(ray_session, tmp_path):
    """The product path: DataParallelStep(split="positions") on two Ray Train workers (gloo), each training its
    position shard of every row, leaves the weights of one in-process step on the whole batch (clip and AdamW
    included; float32, so held as test_scaleout holds DDP: the first AdamW step moves a weight by ~lr * sign(g))."""
    import copy

    from tests.trainer.test_scaleout import assert_same_first_adamw_step, world_target
    from trainer.scaleout import DataParallelStep
    from trainer.step import StepConfig, adamw, set_lr, train_step
    from trainer.traffic import make_traffic_batch

    target = world_target()
    head = copy.deepcopy(ray_world_head(target))
    rows = traffic_rows(target, 3, seed=2)
    cfg = StepConfig(max_loss_rows=None, bf16=False)
    lr = 1e-2
    ref = copy.deepcopy(head).float().train()
    opt = adamw(ref, lr)
    set_lr(opt, lr)
    want = train_step(ref, make_traffic_batch(target, ref, rows, "cpu").batch, opt, None, cfg, step=0)

    group = DataParallelStep(2, device="cpu", storage=tmp_path / "ray-train", target_builder=world_target,
                             split="positions")
    try:
        start = copy.deepcopy(head).float()
        group.load(start, adamw(start, lr), lr, 0.0)
        got, tokens, regenerated = group.step(rows, 0, lr, cfg)
        state = group.state()
    finally:
        group.close()
    assert tokens == got.tokens == sum(r.tokens for r in rows) and regenerated == 1  # the one uncaptured row
    assert got.loss == pytest.approx(want.loss, rel=1e-5) and got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
    assert got.step_count == want.step_count and got.step_correct == want.step_correct
    grads = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
    tight = total = 0
    for k, v in ref.state_dict().items():
        if k == "embed_tokens.weight":
            continue
        if k not in grads:
            assert torch.equal(state["state"][k], v), k
            continue
        mask = assert_same_first_adamw_step(state["state"][k], v, head.state_dict()[k].float(), grads[k], lr, k)
        tight, total = tight + int(mask.sum()), total + mask.numel()
    assert tight >= 0.95 * total


def ray_world_head(target):
    """The head of tests/trainer/test_scaleout.py's world (dense, float32), on its target."""
    from tests.adaptive_eagle.test_engine import tiny_setup
    from tests.trainer.test_scaleout import SEED

    head = tiny_setup(seed=SEED, dtype=torch.float32)[1]
    assert torch.equal(head.embed_tokens.weight, target.input_embeddings())
    return head


def test_the_near_line_trainer_chooses_sequence_parallel_by_configuration(tmp_path):
    from feature_store.config import StoreConfig
    from trainer.config import NearlineConfig

    base = dict(registry=str(tmp_path), work_dir=str(tmp_path), store=StoreConfig(backend="local",
                local_root=str(tmp_path)))
    assert NearlineConfig(**base).sequence_parallel == 1
    assert NearlineConfig(**base, workers=4, sequence_parallel=4).sequence_parallel == 4
    with pytest.raises(ValueError, match=r"sequence_parallel 2 must be 1 or equal workers \(4\)"):
        NearlineConfig(**base, workers=4, sequence_parallel=2)
    with pytest.raises(ValueError, match="sequence_parallel"):
        NearlineConfig(**base, sequence_parallel=0)
