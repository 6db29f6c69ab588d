"""`train-head` with `sequence_parallel: N` (trainer/offline.py SequenceParallelStep): the offline loop's updates on
a Ray Train worker group that splits every batch's rows by position (trainer/scaleout.py, trainer/seqpar.py).

The proof: two steps of the loop on two workers leave the head of two in-process steps (float32 on both sides;
held as tests/trainer/test_scaleout.py holds DDP: AdamW moves a weight by about lr * sign(g) whatever |g| is, so
weights whose gradient is at rounding level may move either way; all the others agree to float rounding). MoE
heads are refused before any worker starts.
"""

import functools

import pytest
import torch

from adaptive_eagle.targets import load_target, tiny_target
from tests.trainer.test_train_loop import BATCH_TOKENS, DRAFT_VOCAB, MAX_LEN, arithmetic_example, recipe
from trainer.offline import (TrainHeadConfig, batches, collate, load_run_state, shuffled, traffic_rows, train_loop,
                             worker_target)
from trainer.traffic import collate_rows
from trainer.warm_start import build_draft_vocab, new_head, token_counts

LR = 3e-3
TARGET = functools.partial(tiny_target, seed=0, initializer_range=0.1)  # every worker builds the same target


@pytest.fixture(scope="module")
def small():
    target = TARGET()
    vocab_size = target.config.vocab_size
    train = [arithmetic_example(i, vocab_size, n=30 + 2 * (i % 5)) for i in range(16)]
    heldout = [arithmetic_example(i, vocab_size) for i in range(1000, 1002)]
    vocab = build_draft_vocab(token_counts(train), DRAFT_VOCAB, vocab_size)
    return target, train, heldout, vocab


def two_step_budget(train, seed: int = 0) -> int:
    """A token budget the loop reaches at its second step (the first two batches of epoch 0)."""
    first = next(iter(batches(train, shuffled(len(train), seed, 0), BATCH_TOKENS, MAX_LEN)))[1]
    return sum(min(len(e.input_ids), MAX_LEN) for e in first) + 1


def test_sequence_parallel_train_head_leaves_the_in_process_head(ray_session, small, tmp_path):
    target, train, heldout, vocab = small
    start = new_head(target, vocab, seed=0)
    before = {k: v.clone() for k, v in start.state_dict().items()}
    budget = two_step_budget(train)
    quiet = dict(progress=False, log=lambda s: None)

    ref_head = new_head(target, vocab, seed=0)
    ref_cfg = recipe(token_budget=budget, warmup_steps=0, lr=LR)
    want, want_eval = train_loop(ref_cfg, tmp_path / "in-process", target, ref_head, train, heldout, **quiet)

    cfg = recipe(token_budget=budget, warmup_steps=0, lr=LR, sequence_parallel=2)
    got, got_eval = train_loop(cfg, tmp_path / "seqpar", target, start, train, heldout, target_builder=TARGET,
                               **quiet)

    assert ray_session.is_initialized()  # the fixture's Ray: used, not shut down
    assert (got.step, got.tokens, got.epoch, got.cursor) == (want.step, want.tokens, want.epoch, want.cursor)
    assert got.step == 2
    assert got_eval["loss"] == pytest.approx(want_eval["loss"], rel=1e-4)
    assert got_eval["top1"] == pytest.approx(want_eval["top1"], abs=1e-6)
    tight = total = 0
    for k, w in ref_head.state_dict().items():
        g = start.state_dict()[k]
        if torch.equal(w, before[k]):  # frozen embedding, vocabulary maps, parameters without gradient
            assert torch.equal(g, w), k
            continue
        close = torch.isclose(g, w, rtol=1e-4, atol=1e-6)
        tight, total = tight + int(close.sum()), total + close.numel()
        assert float((g - w).abs().max()) <= 4 * LR, k  # two AdamW steps, each moves a weight by about lr at most
    assert total > 0 and tight >= 0.95 * total, (tight, total)
    # the run state holds the workers' head and optimizer (pulled back before the checkpoint)
    saved, meta, opt_tensors = load_run_state(tmp_path / "seqpar", target)
    assert meta["state"]["step"] == 2 and float(opt_tensors["0.step"]) == 2
    for k, v in saved.state_dict().items():
        assert torch.equal(v, start.state_dict()[k]), k


def test_rows_for_the_workers_are_the_batch_the_in_process_step_collates(small):
    _, train, _, _ = small
    exs = train[:5]
    rows = traffic_rows(exs, max_len=31)
    assert all(r.aux is None and r.final is None for r in rows)  # each worker regenerates the features
    for a, b in zip(collate_rows(rows), collate(exs, max_len=31)):
        assert torch.equal(a, b)


def test_workers_load_the_target_by_name_with_the_loops_layers_and_dtype(small):
    target = small[0]
    build = worker_target(TrainHeadConfig(target="smollm2-135m"), target)
    assert build.func is load_target and build.args == ("smollm2-135m",)  # a module-level function: ships to workers
    assert build.keywords == {"device": "cpu", "dtype": torch.float32, "aux_layer_ids": tuple(target.aux_layer_ids),
                              "purpose": "train"}


def test_sequence_parallel_is_refused_for_moe_heads_and_out_of_range(small, tmp_path):
    with pytest.raises(ValueError, match="sequence_parallel 2 with num_experts 4: sequence parallel trains a dense"):
        TrainHeadConfig(num_experts=4, sequence_parallel=2)
    assert TrainHeadConfig(num_experts=4).sequence_parallel == 1
    for bad in (0, 65):
        with pytest.raises(ValueError, match="sequence_parallel"):
            TrainHeadConfig(sequence_parallel=bad)
    # an MoE head given to a dense recipe (a fine-tuned or resumed head): refused before any worker starts
    target, train, heldout, vocab = small
    moe = new_head(target, vocab, num_experts=2, num_experts_per_tok=1, seed=0)
    with pytest.raises(ValueError, match="sequence_parallel 2 with num_experts 2: .* recipe's num_experts is 1"):
        train_loop(recipe(sequence_parallel=2), tmp_path / "run", target, moe, train, heldout, progress=False,
                   log=lambda s: None, target_builder=TARGET)
    assert not (tmp_path / "run" / "ray-train").exists()


def test_the_cli_passes_sequence_parallel_and_refuses_it_with_moe(tmp_path):
    from typer.testing import CliRunner

    from adaptive_eagle_cli import app

    def run(*args):
        return CliRunner().invoke(app, ["train-head", "--out", str(tmp_path / "out"), *args],
                                  env={"COLUMNS": "250", "NO_COLOR": "1"})

    res = run("--sequence-parallel", "2", "--num-experts", "2")
    assert res.exit_code != 0 and "error:" in res.output
    assert "sequence_parallel 2 with num_experts 2" in res.output
    res = run("--sequence-parallel", "0")
    assert res.exit_code != 0 and "sequence_parallel" in res.output and "greater than or equal to 1" in res.output
    assert not (tmp_path / "out").exists()
    assert "--sequence-parallel" in CliRunner().invoke(app, ["train-head", "--help"],
                                                       env={"COLUMNS": "250", "NO_COLOR": "1"}).output
