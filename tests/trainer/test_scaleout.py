"""Scale-out: the near-line step on a Ray Train worker group (TorchTrainer, DDP over gloo), tiny target.

The proof that DDP really averages: one data-parallel step over two workers, each holding half the rows,
leaves exactly the weights of one in-process step whose loss is the mean of the two halves' losses (the
gradient DDP's all-reduce computes), clip and AdamW included. Then the NearlineTrainer with workers=2
trains, checkpoints and writes a candidate from the workers' weights.
"""

import copy

import pytest
import torch

from adaptive_eagle.checkpoint import HeadMeta
from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle.trace import SamplingParams
from feature_store.config import StoreConfig
from feature_store.writer import write_records
from tests.adaptive_eagle.test_engine import tiny_setup
from trainer.config import NearlineConfig
from trainer.nearline import NearlineTrainer
from trainer.scaleout import DataParallelStep, merge_stats, shards
from trainer.step import StepConfig, StepStats, adamw, set_lr, train_step
from trainer.traffic import make_traffic_batch, row_from_record
from trainer.ttt import ttt_loss

SEED = 11


def world_target():
    """The same tiny target in every worker process (seeded)."""
    return tiny_setup(seed=SEED, dtype=torch.float32)[0]


@pytest.fixture(scope="module")
def world():
    target, head = tiny_setup(seed=SEED, dtype=torch.float32)
    engine = SpeculativeEngine(target, head, EngineConfig(cost_aware=False, calibration_dir=""), head_version="v1")
    engine.eos_ids = set()
    g = torch.Generator().manual_seed(0)
    records = []
    for i in range(12):
        prompt = torch.randint(0, 32, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        records.append(engine.generate(prompt, SamplingParams(max_tokens=20), capture=True,
                                       request_id=f"req-{i}").trace)
    return target, head, records


def test_shards_cover_every_row_once_and_spare_workers_get_copies():
    assert shards(list("abcde"), 2) == [["a", "c", "e"], ["b", "d"]]
    assert shards(["a"], 3) == [["a"], ["a"], ["a"]]
    with pytest.raises(ValueError):
        shards([], 2)


def test_merged_stats_weight_each_worker_by_the_positions_it_scored():
    a = StepStats(step=3, lr=1e-3, loss=2.0, grad_norm=0.5, tokens=10, step_loss=(2.0, 4.0), step_correct=(1, 0),
                  step_count=(10, 5))
    b = StepStats(step=3, lr=1e-3, loss=1.0, grad_norm=0.5, tokens=30, step_loss=(1.0, 1.0), step_correct=(6, 2),
                  step_count=(30, 15))
    m = merge_stats([a, b], tokens=40)
    assert m.tokens == 40 and m.step_count == (40, 20) and m.step_correct == (7, 2)
    assert m.step_loss == pytest.approx((1.25, 1.75)) and m.loss == pytest.approx((2.0 * 15 + 1.0 * 45) / 60)
    assert m.grad_norm == 0.5 and not m.skipped


def assert_same_first_adamw_step(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor, grad: torch.Tensor,
                                 lr: float, name: str) -> torch.Tensor:
    """Two first AdamW steps from the same weights, whose gradients differ only by summation order.

    A first AdamW step moves a weight by lr * g / (|g| + eps) (bias-corrected moments m = g, v = g**2): about
    lr * sign(g), whatever |g| is. Where |g| is far above the gradient's rounding (~1e-5 of the tensor's
    largest entry after two float32 all-reduce orders; 2e-4 keeps a wide margin) the two steps agree to float
    rounding. Below it the sign itself is rounding noise, and a correct step may move that weight either way:
    there only the step's bound |change| <= lr holds. Returns the mask of weights held to the tight tolerance."""
    tight = grad.abs() > 2e-4 * grad.abs().max()
    torch.testing.assert_close(got[tight], want[tight], rtol=1e-4, atol=1e-6, msg=name)
    loose = ~tight
    assert bool(((got[loose] - before[loose]).abs() <= lr * (1 + 1e-3)).all()), name
    return tight


def test_a_data_parallel_step_equals_one_step_on_the_mean_of_the_shards_losses(ray_session, world, tmp_path):
    target, head, records = world
    rows = [row_from_record(r, head.cfg.aux_layer_ids, "generated", 256) for r in records[:4]]
    cfg = StepConfig(max_loss_rows=None, bf16=False)
    lr = 1e-2

    # in-process reference: the gradient of the mean of the two shards' losses, then clip and AdamW
    ref = copy.deepcopy(head).float().train()
    opt = adamw(ref, lr)
    set_lr(opt, lr)
    b0, b1 = (make_traffic_batch(target, ref, part, "cpu").batch for part in shards(rows, 2))

    def mean_of_shards(batch):
        o0 = ttt_loss(ref, b0, steps=cfg.ttt_steps, decay=cfg.step_decay)
        o1 = ttt_loss(ref, b1, steps=cfg.ttt_steps, decay=cfg.step_decay)
        return (o0.loss + o1.loss) / 2, o0

    want = train_step(ref, b0, opt, None, cfg, step=0, objective=mean_of_shards)

    dp = DataParallelStep(2, device="cpu", storage=tmp_path / "ray-train", target_builder=world_target)
    try:
        start = copy.deepcopy(head).float()
        dp.load(start, adamw(start, lr), lr, 0.0)
        got, tokens, regenerated = dp.step(rows, 0, lr, cfg)
        state = dp.state()
    finally:
        dp.close()
    assert tokens == sum(len(r.input_ids) for r in rows) and regenerated == 0
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4) and not got.skipped
    expected = {k: v for k, v in ref.state_dict().items() if k != "embed_tokens.weight"}
    assert set(state["state"]) == set(expected)
    grads = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
    assert grads and set(grads) <= set(expected)
    changed = well_conditioned = total = 0
    for k, v in expected.items():
        if k not in grads:  # buffers (the draft vocabulary maps): untouched by both
            assert torch.equal(state["state"][k], v), k
            continue
        before = head.state_dict()[k].float()
        tight = assert_same_first_adamw_step(state["state"][k], v, before, grads[k], lr, k)
        well_conditioned, total = well_conditioned + int(tight.sum()), total + tight.numel()
        changed += not torch.equal(v, before)
    assert changed > 0  # the step moved the weights, and both ways moved them alike
    assert well_conditioned >= 0.95 * total  # nearly every weight was held to the tight tolerance
    assert len(state["optimizer"]["state"]) == len(opt.state_dict()["state"])


def test_nearline_trainer_with_two_workers_trains_checkpoints_and_writes_a_candidate(ray_session, world, tmp_path):
    target, head, records = world
    reg = HeadRegistry.create(tmp_path / "registry")
    reg.register(head, HeadMeta.new("v1", target.name, target.fingerprint), dtype=torch.float32)
    reg.set_champion("v1", expect="none")
    store = StoreConfig(backend="local", local_root=str(tmp_path / "store"), fsync=False)
    write_records(store, records)
    cfg = NearlineConfig(registry=str(tmp_path / "registry"), work_dir=str(tmp_path / "work"), store=store,
                         batch_tokens=256, min_fresh_tokens=32, max_loss_rows=None, lr=1e-3, warmup_steps=0,
                         heldout_percent=20, candidate_every_tokens=200, min_candidate_tokens=100,
                         min_candidate_heldout=1, tree_depth=3, tree_topk=2, tree_draft_tokens=6, workers=2, bf16=False)
    tr = NearlineTrainer(cfg, target=target, worker_target=world_target)
    try:
        tr.start()
        tr.poll()
        while tr.fresh:
            tr.train_once(force=True)
        assert tr.counters["steps"] >= 2 and tr.counters["records_trained"] == len(tr.seen_requests) - sum(
            len(p) for p in tr.heldout.values())
        before = {k: v.clone() for k, v in tr.head.state_dict().items()}
        tr.checkpoint()  # pulls the workers' weights first
        assert any(not torch.equal(before[k], v) for k, v in tr.head.state_dict().items())
        name = tr.write_candidate()
        assert tr.registry.version(name).training["trainer"] == "nearline"
        # the promotion of the line's own snapshot keeps the line, on the workers too; a champion from elsewhere
        # (a rollback) reaches them: the next step starts from it
        tr.registry.set_champion(name, expect="v1")
        assert tr.follow_champion() and tr.learner.pushed
        tr.registry.set_champion("v1", expect=name)
        assert tr.follow_champion() and not tr.learner.pushed
    finally:
        tr.close()
    assert any("data-parallel step on 2 Ray Train workers" in e for e in tr.events)


def test_moe_growth_and_workers_are_refused_together(tmp_path):
    with pytest.raises(ValueError, match="moe_grow needs workers 1"):
        NearlineConfig(registry=str(tmp_path), work_dir=str(tmp_path), store=StoreConfig(backend="local",
                       local_root=str(tmp_path)), workers=2, moe_grow=True)
