"""trainer.step: the one training step every loop calls. It is exactly the update the offline loop
used to inline, follows its schedule, runs autocast on the batch's device, and skips a poisoned update."""

import dataclasses
import math
import os

import pytest
import torch

from adaptive_eagle.draft_head import DraftHeadConfig, Eagle3DraftHead, init_weights
from adaptive_eagle.targets import tiny_target
from trainer.offline import TrainHeadConfig, lr_at
from trainer.step import StepConfig, StepStats, WarmupCosine, adamw, train_step
from trainer.ttt import TTTBatch, ttt_loss

DEVICE = os.environ.get("ADAPTIVE_EAGLE_TEST_DEVICE", "cpu")  # bench/gpu_check.sh sets cuda
DRAFT_VOCAB, TTT_STEPS = 48, 3


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0, initializer_range=0.1)


def make_head(target, seed=0) -> Eagle3DraftHead:
    cfg = DraftHeadConfig.from_target(target.config, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=target.aux_layer_ids)
    torch.manual_seed(seed)
    head = Eagle3DraftHead(cfg)
    init_weights(head, std=0.1)
    head.embed_tokens.weight.data.copy_(target.input_embeddings())
    head.set_draft_vocab(torch.randperm(cfg.vocab_size)[:DRAFT_VOCAB].sort().values)
    return head.to(DEVICE)


def make_batch(target, head, seed=0, b=2, t=20) -> TTTBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.config.vocab_size, (b, t), generator=g)
    lengths = torch.tensor([t, t - 4][:b])
    mask = torch.ones(b, t, dtype=torch.long)
    mask[:, :4] = 0
    feats = target.features(ids, (torch.arange(t)[None] < lengths[:, None]).long())
    w = target.output_embeddings()[head.draft_to_target.cpu()]
    batch = TTTBatch.build(ids, mask, lengths, feats.aux, lambda need: feats.last[need] @ w.T)
    return TTTBatch(**{f.name: (v.to(DEVICE) if torch.is_tensor(v) else v)
                       for f in dataclasses.fields(batch) for v in [getattr(batch, f.name)]})


def params_of(head):
    return {k: v.detach().clone() for k, v in head.named_parameters()}


def test_step_is_the_update_the_loop_inlined(target):
    """Bit for bit what train_loop did before the step was carved out (lr, loss, clip, AdamW)."""
    cfg = StepConfig(ttt_steps=TTT_STEPS, max_loss_rows=8, grad_clip=0.5)
    schedule = WarmupCosine(lr=3e-3, total_steps=10, warmup_steps=2)
    a, b = make_head(target), make_head(target)
    opt_a, opt_b = adamw(a, 3e-3), adamw(b, 3e-3)
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for step in range(3):
        batch = make_batch(target, a, seed=step)
        stats = train_step(a, batch, opt_a, schedule, cfg, step=step, generator=gen_a)
        for g in opt_b.param_groups:  # the inlined update, as train_loop had it
            g["lr"] = schedule(step)
        out = ttt_loss(b, batch, steps=TTT_STEPS, decay=cfg.step_decay, max_loss_rows=8, generator=gen_b)
        opt_b.zero_grad(set_to_none=True)
        out.loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(b.trainable_parameters(), 0.5)
        opt_b.step()
        assert stats.step == step and stats.lr == schedule(step) and not stats.skipped
        assert stats.loss == float(out.loss.detach()) and stats.grad_norm == float(gnorm)
        assert stats.tokens == int(batch.lengths.sum())
        assert stats.step_correct == tuple(out.step_correct) and stats.step_count == tuple(out.step_count)
        assert len(stats.step_loss) == TTT_STEPS
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_steps_lower_the_loss_on_a_repeated_batch(target):
    head = make_head(target)
    opt = adamw(head, 3e-3)
    batch = make_batch(target, head)
    cfg = StepConfig(ttt_steps=TTT_STEPS, max_loss_rows=None)
    losses = [train_step(head, batch, opt, None, cfg, step=i).loss for i in range(12)]
    assert losses[-1] < losses[0] - 0.1, losses
    assert opt.param_groups[0]["lr"] == 3e-3  # schedule None keeps the optimizer's lr


def test_stats_are_frozen(target):
    head = make_head(target)
    stats = train_step(head, make_batch(target, head), adamw(head, 1e-3), None, StepConfig(ttt_steps=2), step=0)
    assert isinstance(stats, StepStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.loss = 0.0


def test_non_finite_gradient_skips_the_update(target):
    head = make_head(target)
    opt = adamw(head, 1e-3)
    good = make_batch(target, head)
    cfg = StepConfig(ttt_steps=TTT_STEPS)
    train_step(head, good, opt, None, cfg, step=0)  # the optimizer has state to protect
    before, opt_before = params_of(head), {i: {k: v.clone() for k, v in s.items()} for i, s in
                                           enumerate(opt.state.values())}
    poisoned = dataclasses.replace(good, aux=torch.full_like(good.aux, float("nan")))
    stats = train_step(head, poisoned, opt, None, cfg, step=1)
    assert stats.skipped and not math.isfinite(stats.grad_norm)
    for name, p in head.named_parameters():
        assert torch.equal(p, before[name]), name
    for i, s in enumerate(opt.state.values()):
        for k, v in s.items():
            assert torch.equal(v, opt_before[i][k]), (i, k)
    assert all(p.grad is None for p in head.trainable_parameters())
    assert not train_step(head, good, opt, None, cfg, step=2).skipped  # and training goes on


def test_autocast_runs_on_the_batch_device(target, monkeypatch):
    seen = []
    real = torch.autocast

    def spy(device_type, *args, **kw):
        seen.append((device_type, kw.get("enabled")))
        return real(device_type, *args, **kw)

    monkeypatch.setattr(torch, "autocast", spy)
    head = make_head(target)
    batch = make_batch(target, head)
    stats = train_step(head, batch, adamw(head, 1e-3), None, StepConfig(ttt_steps=2, bf16=True), step=0)
    assert seen == [(torch.device(DEVICE).type, True)]
    assert math.isfinite(stats.loss) and not stats.skipped


def test_schedule_matches_the_recipe():
    cfg = TrainHeadConfig(lr=1e-3, warmup_steps=4, min_lr_ratio=0.1)
    s = cfg.schedule(total_steps=20)
    assert [s(i) for i in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert s(4) == pytest.approx(1e-3) and s(20) == pytest.approx(1e-4) and s(500) == pytest.approx(1e-4)
    assert all(s(i) >= s(i + 1) for i in range(4, 25))
    assert lr_at(7, 20, cfg) == s(7)
    assert WarmupCosine(lr=0.5, total_steps=1)(0) == pytest.approx(0.5)  # no warmup: starts at the peak


def test_recipe_projects_onto_the_step_config():
    cfg = TrainHeadConfig(ttt_steps=5, step_decay=0.7, max_loss_rows=None, grad_clip=2.0, bf16=None)
    assert cfg.step_config() == StepConfig(ttt_steps=5, step_decay=0.7, max_loss_rows=None, grad_clip=2.0, bf16=False)
    assert TrainHeadConfig(bf16=True).step_config().bf16 is True


@pytest.mark.parametrize("bad", [dict(ttt_steps=0), dict(step_decay=0.0), dict(step_decay=1.5),
                                 dict(max_loss_rows=0), dict(grad_clip=0.0)])
def test_step_config_is_checked(bad):
    with pytest.raises(ValueError):
        StepConfig(**bad)


def test_extra_loss_is_added_after_the_forward_and_trained(target):
    """The one seam for another loss term: called once per step, after the TTT forward, added before backward."""
    a, b = make_head(target), make_head(target)
    batch = make_batch(target, a)
    cfg = StepConfig(ttt_steps=2, max_loss_rows=None)
    calls = []

    def extra():
        calls.append(1)
        return (b.lm_head.weight ** 2).sum()

    plain = train_step(a, batch, adamw(a, 1e-3), None, cfg, step=0)
    before = b.lm_head.weight.detach().clone()
    with_extra = train_step(b, batch, adamw(b, 1e-3), None, cfg, step=0, extra_loss=extra)
    assert calls == [1]
    assert with_extra.loss == pytest.approx(plain.loss + float((before ** 2).sum()), rel=1e-5)
    assert not torch.equal(b.lm_head.weight, a.lm_head.weight)  # the extra term's gradient reached the update


def test_wall_clock_cosine_warms_up_by_steps_then_decays_over_the_seconds():
    from trainer.step import WallClockCosine, cosine_lr

    now = [0.0]
    s = WallClockCosine(lr=1.0, budget_s=100.0, seconds_run=lambda: now[0], warmup_steps=4, min_lr_ratio=0.1)
    assert [s(k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == 1.0  # no time spent yet: the peak
    now[0] = 50.0
    assert s(9) == pytest.approx(0.55) == cosine_lr(1.0, 0.1, 0.5)
    now[0] = 250.0
    assert s(10) == pytest.approx(0.1)  # past the budget: held at the floor
    assert WarmupCosine(lr=1.0, total_steps=12, warmup_steps=2)(7) == cosine_lr(1.0, 0.1, 0.5)
