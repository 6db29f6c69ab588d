"""The offline training loop on a tiny target: it learns, its run state resumes exactly, the warm start copies what
the target can give, and the loop stops, evaluates, checkpoints and decays its lr by the budget and cadence given."""

import dataclasses
import json

import pytest
import torch

from adaptive_eagle.draft_head import causal_attend
from adaptive_eagle.targets import tiny_target
from trainer.data import TokenizedExample
from trainer.budget import Budget, Cadence
from trainer.offline import (
    RunState,
    TrainHeadConfig,
    estimate_total_steps,
    evaluate,
    load_run_state,
    loop_schedule,
    restore_optimizer,
    save_run_state,
    train_loop,
)
from trainer.warm_start import build_draft_vocab, new_head, token_counts, warm_start

MAX_LEN, BATCH_TOKENS, TTT_STEPS, DRAFT_VOCAB = 64, 400, 3, 64


def arithmetic_example(i: int, vocab: int, n: int = 48) -> TokenizedExample:
    """A learnable sequence: an arithmetic progression of token ids (start and stride vary with i)."""
    start, stride = 3 + (i * 7) % 50, 1 + i % 5
    ids = [1] + [3 + (start + stride * k) % (vocab - 3) for k in range(n - 1)]
    return TokenizedExample(id=f"ex{i}", domain="english", input_ids=ids, loss_mask=[0] * 8 + [1] * (n - 8))


def recipe(**kw) -> TrainHeadConfig:
    base = dict(target="tiny", bf16=False, token_budget=12_000, batch_tokens=BATCH_TOKENS, max_len=MAX_LEN,
                eval_every=1000, checkpoint_minutes=100, max_loss_rows=None, warmup_steps=2, lr=3e-3,
                ttt_steps=TTT_STEPS)
    base.update(kw)
    return TrainHeadConfig(**base)


def held_out(head, target, examples):
    return evaluate(head, target, examples, max_len=MAX_LEN, batch_tokens=BATCH_TOKENS, steps=TTT_STEPS, bf16=False)


@pytest.fixture(scope="module")
def setup():
    # a wider init than the default 0.02 gives the random target peaked (learnable) next-token distributions
    target = tiny_target(seed=0, initializer_range=0.1)
    vocab_size = target.config.vocab_size
    train = [arithmetic_example(i, vocab_size) for i in range(40)]
    heldout = [arithmetic_example(i, vocab_size) for i in range(1000, 1006)]
    vocab = build_draft_vocab(token_counts(train), DRAFT_VOCAB, vocab_size)
    return target, train, heldout, vocab


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):
    target, train, heldout, vocab = setup
    head = new_head(target, vocab, seed=0)
    initial = {k: v.clone() for k, v in head.state_dict().items()}
    before = held_out(head, target, heldout)
    run_dir = tmp_path_factory.mktemp("run")
    cfg = recipe()
    state, last = train_loop(cfg, run_dir, target, head, train, heldout, extra={"vocab": {"size": DRAFT_VOCAB}},
                             progress=False, log=lambda s: None)
    return dict(target=target, head=head, initial=initial, before=before, after=held_out(head, target, heldout),
                state=state, last=last, run_dir=run_dir, cfg=cfg)


def test_training_lowers_held_out_loss_and_raises_top1(trained):
    before, after, state = trained["before"], trained["after"], trained["state"]
    assert state.tokens >= trained["cfg"].token_budget and state.step >= 20
    assert after["loss"] < before["loss"] - 0.2, (before["loss"], after["loss"])
    assert after["top1"][0] >= before["top1"][0] + 0.1, (before["top1"], after["top1"])
    assert after["alpha"][0] == after["top1"][0] and after["accept_length"] > before["accept_length"]
    assert trained["last"]["loss"] == pytest.approx(after["loss"], rel=1e-5)  # the loop's final evaluation
    assert [h["step"] for h in state.history] == [state.step]
    # the frozen embeddings and the vocabulary buffers did not move
    sd = trained["head"].state_dict()
    for key in ("embed_tokens.weight", "d2t", "t2d"):
        assert torch.equal(sd[key], trained["initial"][key])
    assert not torch.equal(sd["fc.weight"], trained["initial"]["fc.weight"])


def test_run_state_restores_the_head_bit_exactly(trained):
    run_dir, head, target = trained["run_dir"], trained["head"], trained["target"]
    assert {p.name for p in (run_dir / "state").iterdir()} == {"head.safetensors", "optimizer.safetensors",
                                                              "trainer.json"}
    loaded, meta, opt_tensors = load_run_state(run_dir, target)
    assert loaded.cfg == head.cfg
    want, got = head.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert not loaded.embed_tokens.weight.requires_grad
    state = RunState(**meta["state"])
    assert (state.step, state.tokens) == (trained["state"].step, trained["state"].tokens)
    assert meta["recipe"] == trained["cfg"].model_dump() and meta["vocab"] == {"size": DRAFT_VOCAB}
    # AdamW state of every trainable parameter, at the run's step count
    n_params = len(head.trainable_parameters())
    assert {k.split(".", 1)[1] for k in opt_tensors} == {"step", "exp_avg", "exp_avg_sq"}
    assert len(opt_tensors) == 3 * n_params
    assert all(float(opt_tensors[f"{i}.step"]) == state.step for i in range(n_params))


def test_resumed_run_continues_from_its_step(trained, setup):
    target, train, heldout, _ = setup
    run_dir = trained["run_dir"]
    head, meta, opt_tensors = load_run_state(run_dir, target)
    saved = RunState(**meta["state"])
    cfg = recipe(token_budget=saved.tokens + 800)
    state, _ = train_loop(cfg, run_dir, target, head, train, heldout, state=RunState(**meta["state"]),
                          opt_tensors=opt_tensors, opt_meta=meta, progress=False, log=lambda s: None)
    assert state.step > saved.step and state.tokens >= cfg.token_budget
    _, meta2, opt2 = load_run_state(run_dir, target)
    assert meta2["state"]["step"] == state.step and float(opt2["0.step"]) == state.step


def test_optimizer_state_round_trips(setup, tmp_path):
    target, train, heldout, vocab = setup
    cfg = recipe()

    def adamw(head):
        return torch.optim.AdamW(head.trainable_parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)

    def fake_step(head, opt, seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, target.config.vocab_size, (2, 12), generator=g)
        aux = torch.randn(2, 12, 3 * target.config.hidden_size, generator=g)
        out = head.step(ids, aux, torch.arange(12)[None].expand(2, 12), causal_attend)
        opt.zero_grad(set_to_none=True)
        out.logits.float().logsumexp(-1).mean().backward()
        opt.step()

    head = new_head(target, vocab, seed=3)
    opt = adamw(head)
    for seed in range(3):
        fake_step(head, opt, seed)
    for g in opt.param_groups:
        g["lr"] = 1.234e-3  # a scheduled lr must survive too
    save_run_state(tmp_path, head, opt, RunState(step=3, tokens=72, history=[]), cfg, {})
    head2, meta, tensors = load_run_state(tmp_path, target)
    opt2 = adamw(head2)
    restore_optimizer(opt2, tensors, meta)
    a, b = opt.state_dict(), opt2.state_dict()
    assert json_equal(a["param_groups"], b["param_groups"])  # lr, betas, weight decay, param indices
    assert b["param_groups"][0]["lr"] == 1.234e-3
    assert a["state"].keys() == b["state"].keys()
    for idx in a["state"]:
        for name, val in a["state"][idx].items():
            assert torch.equal(b["state"][idx][name], val), (idx, name)
    # the next update is identical
    fake_step(head, opt, 99)
    fake_step(head2, opt2, 99)
    for (n1, p1), (n2, p2) in zip(head.named_parameters(), head2.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def json_equal(x, y) -> bool:
    """Equal up to tuple/list (the run state stores param groups as JSON)."""
    return json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True)


def test_warm_start_copies_from_the_target(setup):
    _, train, _, vocab = setup
    target = tiny_target(seed=1)
    m = target.model
    with torch.no_grad():  # make the copied norms distinguishable from the ones a fresh head has
        m.model.norm.weight.uniform_(0.5, 1.5)
        for layer in m.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    head = new_head(target, vocab, seed=0)
    summary = warm_start(head, target)
    last = m.model.layers[-1]
    h = target.config.hidden_size
    assert summary["from_layer"] == target.num_layers - 1
    assert torch.equal(head.lm_head.weight, target.output_embeddings()[head.draft_to_target])
    assert torch.equal(head.norm.weight, m.model.norm.weight)
    attn = head.midlayer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):  # the hidden half of q/k/v reads like the target layer
        assert torch.equal(getattr(attn, name).weight[:, h:], getattr(last.self_attn, name).weight)
    assert torch.equal(attn.o_proj.weight, last.self_attn.o_proj.weight)
    assert torch.equal(head.midlayer.hidden_norm.weight, last.input_layernorm.weight)
    assert torch.equal(head.midlayer.post_attention_layernorm.weight, last.post_attention_layernorm.weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(head.midlayer.mlp, name).weight, getattr(last.mlp, name).weight)
    deepest = head.fc.weight[:, 2 * h : 3 * h]  # fc passes the deepest aux block through (plus small noise)
    assert (deepest - torch.eye(h)).abs().max() < 0.05

    ids = torch.tensor([ex.input_ids[:20] for ex in train[:2]])
    feats = target.features(ids)
    with torch.no_grad():
        out = head.step(ids.roll(-1, dims=1), feats.aux, torch.arange(20)[None].expand(2, 20), causal_attend)
    assert out.logits.shape == (2, 20, DRAFT_VOCAB) and out.hidden.shape == (2, 20, h)
    assert torch.isfinite(out.logits).all()


def test_recipe_is_frozen_and_checked():
    cfg = recipe()
    with pytest.raises(Exception):
        cfg.lr = 1.0
    with pytest.raises(Exception):
        recipe(max_len=8)
    assert dataclasses.is_dataclass(RunState)


def test_a_step_budget_with_a_wall_clock_cadence_checkpoints_and_calls_back(setup, tmp_path):
    """What the GPU window asks of the loop: stop at a step count, evaluate and checkpoint by the clock, hear of
    every periodic checkpoint (the run state is saved first, and once more at the end)."""
    target, train, heldout, vocab = setup
    head = new_head(target, vocab, seed=0)
    seen = []

    def on_checkpoint(state: RunState) -> None:
        _, meta, _ = load_run_state(tmp_path, target)
        seen.append((state.step, meta["state"]["step"]))

    cfg = recipe()
    state, last = train_loop(cfg, tmp_path, target, head, train, heldout, progress=False, log=lambda s: None,
                             budget=Budget.of(cfg, steps=3), cadence=Cadence(eval_seconds=0.0, checkpoint_seconds=0.0),
                             on_checkpoint=on_checkpoint)
    assert state.step == 3 and state.skipped == 0 and 0 < state.tokens < cfg.token_budget
    assert seen == [(1, 1), (2, 2), (3, 3)]
    assert [h["step"] for h in state.history] == [1, 2, 3, 3]  # every step by the clock, then the final one
    assert state.history[-1]["loss"] == round(last["loss"], 4)
    _, meta, _ = load_run_state(tmp_path, target)
    assert meta["state"]["step"] == 3 and meta["state"]["skipped"] == 0


def test_a_time_budget_stops_the_loop_and_its_cosine_spans_the_seconds(setup, tmp_path):
    target, train, heldout, vocab = setup
    cfg = recipe(token_budget=10**9, time_budget_min=0.01)  # 0.6 s
    budget = Budget.of(cfg, decay_over="seconds")
    seen: list[float] = []  # the training time at each step's checkpoint
    state, _ = train_loop(cfg, tmp_path, target, new_head(target, vocab, seed=0), train, heldout, progress=False,
                          log=lambda s: None, budget=budget, cadence=Cadence(eval_seconds=1e9, checkpoint_seconds=0.0),
                          on_checkpoint=lambda st: seen.append(st.elapsed_s))
    # the loop stopped at the first step that reached the budget: every step before it was still under it
    assert state.step >= 1 and state.elapsed_s >= 0.6 and all(t < 0.6 for t in seen[:-1])
    now = [0.0]
    schedule = loop_schedule(cfg, budget, train, lambda: now[0])
    assert schedule(0) == cfg.lr / cfg.warmup_steps
    assert schedule(10) == cfg.lr
    now[0] = 0.3
    assert schedule(10) == pytest.approx(cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5))
    by_tokens = loop_schedule(cfg, Budget.of(cfg), train, lambda: now[0])
    assert by_tokens(30) == cfg.schedule(estimate_total_steps(cfg, train))(30)


def test_the_loop_refuses_an_empty_training_set(setup, tmp_path):
    target, _, heldout, vocab = setup
    with pytest.raises(ValueError, match="no training examples"):
        train_loop(recipe(), tmp_path, target, new_head(target, vocab, seed=0), [], heldout, progress=False)
