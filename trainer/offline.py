"""Offline head trainer (`adaptive-eagle train-head`) and held-out evaluation (`eval-head`).

Owns: the offline loop over tokenised conversations (length-bucketed batches, target features
computed once per batch and reused by all TTT steps) on the target's device, its progress bar, resumable
run state (safetensors + JSON, atomic), periodic held-out acceptance, and the choice of schedule for its
budget (trainer.budget: tokens, seconds or steps; evaluation and checkpoints by steps or seconds). The update
itself (AdamW, warmup + cosine, TTT loss under autocast, clipping) is ``trainer.step.train_step``,
the one step every loop calls: in this process (`InProcessStep`), or with `sequence_parallel: N` on a
Ray Train worker group that splits every batch's rows by position (`SequenceParallelStep`, through
trainer.scaleout and trainer.seqpar). Must not touch: serving, the feature store.
"""

from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

import torch
from pydantic import BaseModel, Field, model_validator

from adaptive_eagle.atomic import staging_dir
from adaptive_eagle.draft_head import Eagle3DraftHead
from adaptive_eagle.targets import Target, load_target
from trainer.budget import Budget, Cadence, Every, RunClock
from trainer.data import TokenizedExample
from trainer.positions import PositionTally
from trainer.state import read_state, restore_optimizer, write_state
from trainer.step import (Schedule, StepConfig, StepStats, WallClockCosine, WarmupCosine, adamw,
                          train_step)
from trainer.traffic import TrafficRow
from trainer.ttt import TTTBatch, acceptance_summary, ttt_loss


class TrainHeadConfig(BaseModel, frozen=True):
    """Recipe of one offline training run (saved with the run and into head.json)."""

    target: str = Field("smollm2-135m", description="built-in target name or local HF directory")
    aux_layer_ids: list[int] | None = Field(None, description="inputs of these target layers; None: [2, L//2, L-3]")
    domains: list[str] = Field(["english"], description="ShareGPT domains to train on")
    data_jsonl: str | None = Field(None, description="train on this JSONL instead of ShareGPT")
    max_len: int = Field(1024, ge=16, le=32768, description="tokens per conversation (truncated)")
    batch_tokens: int = Field(4096, ge=64, description="padded tokens per batch")
    token_budget: int = Field(2_000_000, ge=1, description="stop after this many training tokens")
    time_budget_min: float | None = Field(None, gt=0, description="stop after this many minutes")
    lr: float = Field(5e-4, gt=0, le=1.0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    ttt_steps: int = Field(7, ge=1, le=16)
    max_loss_rows: int | None = Field(1024, ge=1, description="positions scored per TTT step (None: all)")
    step_decay: float = Field(0.8, gt=0, le=1)
    draft_vocab_size: int | None = Field(None, ge=64, description="None: smallest size reaching vocab_coverage")
    vocab_coverage: float = Field(0.97, gt=0, le=1)
    vocab_domains: list[str] = Field(["english", "code", "math"], description="domains counted for the vocab")
    num_experts: int = Field(1, ge=1, le=64)
    num_experts_per_tok: int = Field(2, ge=1)
    warm_start: Literal["full", "output", "none"] = Field(
        "full", description="full: lm_head rows, norms and a target decoder layer; output: lm_head + norm; none")
    warm_layer: int | None = None
    bf16: bool | None = Field(None, description="bf16 autocast; None: where the hardware multiplies bf16 natively")
    seed: int = 0
    eval_every: int = Field(100, ge=1, description="steps between held-out evaluations")
    eval_convs: int = Field(24, ge=1)
    checkpoint_minutes: float = Field(5.0, gt=0)
    sequence_parallel: int = Field(1, ge=1, le=64, description=(
        "1: every step in this process. N > 1: every batch's rows split by position over N Ray Train workers "
        "(trainer/seqpar.py: ring attention, the one-process loss and gradient), each regenerating the target's "
        "features for its shard with its own copy of the target; for conversations too long to train in one "
        "process. A dense head only (num_experts 1)"))

    @model_validator(mode="after")
    def _check(self) -> "TrainHeadConfig":
        if self.sequence_parallel > 1 and self.num_experts > 1:
            raise ValueError(moe_refusal(self.sequence_parallel, self.num_experts))
        return self

    def step_config(self) -> StepConfig:
        """What trainer.step.train_step needs from this recipe (bf16 None counts as off: resolve it first)."""
        return StepConfig(ttt_steps=self.ttt_steps, step_decay=self.step_decay, max_loss_rows=self.max_loss_rows,
                          grad_clip=self.grad_clip, bf16=bool(self.bf16))

    def schedule(self, total_steps: int) -> WarmupCosine:
        return WarmupCosine(lr=self.lr, total_steps=total_steps, warmup_steps=self.warmup_steps,
                            min_lr_ratio=self.min_lr_ratio)


def moe_refusal(sequence_parallel: int, num_experts: int) -> str:
    """Why a run with both is refused (trainer.seqpar trains dense heads only)."""
    return (f"sequence_parallel {sequence_parallel} with num_experts {num_experts}: sequence parallel trains a dense "
            "head only (an MoE router's load-balancing loss is not a sum over positions); use num_experts 1, or "
            "sequence_parallel 1 for an MoE head")


@dataclass
class RunState:
    """Where a run stands (saved with its run state; a resumed run counts on from it)."""

    step: int = 0  # optimizer steps taken
    tokens: int = 0  # training tokens seen
    epoch: int = 0
    cursor: int = 0  # position in this epoch's order: batches before it were consumed
    elapsed_s: float = 0.0  # wall time spent training, over every call of the loop
    history: list | None = None  # held-out evaluations along the run (_eval_record)
    skipped: int = 0  # updates skipped for a non-finite gradient norm


# ---- batching ----------------------------------------------------------------------------------
def batches(examples: Sequence[TokenizedExample], order: Sequence[int], batch_tokens: int, max_len: int, window: int = 64):
    """Yield (cursor_after, [examples]) with padded size <= batch_tokens, length-bucketed in windows."""
    for w0 in range(0, len(order), window):
        chunk = sorted(order[w0 : w0 + window], key=lambda i: len(examples[i].input_ids))
        cur: list[int] = []
        for k, i in enumerate(chunk):
            n = min(len(examples[i].input_ids), max_len)
            if cur and n * (len(cur) + 1) > batch_tokens:
                yield w0, [examples[c] for c in cur]
                cur = []
            cur.append(i)
        if cur:
            yield w0 + len(chunk), [examples[c] for c in cur]


def collate(exs: Sequence[TokenizedExample], max_len: int, pad_id: int = 0):
    t = min(max_len, max(len(e.input_ids) for e in exs))
    ids = torch.full((len(exs), t), pad_id, dtype=torch.long)
    mask = torch.zeros(len(exs), t, dtype=torch.long)
    lengths = torch.zeros(len(exs), dtype=torch.long)
    for b, e in enumerate(exs):
        n = min(t, len(e.input_ids))
        ids[b, :n] = torch.tensor(e.input_ids[:n])
        mask[b, :n] = torch.tensor(e.loss_mask[:n])
        lengths[b] = n
    return ids, mask, lengths


def make_ttt_batch(target: Target, head: Eagle3DraftHead, exs, max_len: int, exact: bool = False) -> TTTBatch:
    """One target forward per batch (on the target's device); its features serve every TTT step."""
    ids, mask, lengths = (t.to(target.device) for t in collate(exs, max_len))
    attn = (torch.arange(ids.shape[1], device=ids.device)[None] < lengths[:, None]).long()
    feats = target.features(ids, attn)
    with torch.no_grad():
        w = target.output_embeddings()
        w_draft = w[head.draft_to_target]  # [draft_vocab, H]
        argmax = (feats.last @ w.T).argmax(-1) if exact else None
        return TTTBatch.build(ids, mask, lengths, feats.aux, lambda need: feats.last[need] @ w_draft.T, argmax)


# ---- evaluation -----------------------------------------------------------------------------------
def exact_batches(target: Target, head, examples, max_len: int, batch_tokens: int) -> list[TTTBatch]:
    """Held-out batches in file order, with the target's exact full-vocab argmax (reusable)."""
    return [make_ttt_batch(target, head, exs, max_len, exact=True)
            for _, exs in batches(examples, list(range(len(examples))), batch_tokens, max_len)]


@torch.no_grad()
def evaluate(head, target, examples, *, max_len=1024, batch_tokens=4096, steps=7, bf16=True, cached=None,
             edges: Sequence[int] | None = None) -> dict:
    """Held-out acceptance with the target's exact full-vocab argmax. `cached`: reuse batches (else
    each batch is built when it is scored, so long rows never pile up). `edges`: also slice it by
    context position (trainer.positions), every chain row scored, under "by_position"."""
    head.eval()
    tot = {"correct": [0] * steps, "count": [0] * steps, "accept": [0] * steps, "eligible": [0] * steps}
    tally = PositionTally(edges, steps) if edges is not None else None
    loss_sum, n_batches = 0.0, 0
    batch_list = cached if cached is not None else (
        make_ttt_batch(target, head, exs, max_len, exact=True)
        for _, exs in batches(examples, list(range(len(examples))), batch_tokens, max_len))
    for batch in batch_list:
        with torch.autocast(batch.aux.device.type, dtype=torch.bfloat16, enabled=bool(bf16)):
            out = ttt_loss(head, batch, steps=steps)
        for k, v in (("correct", out.step_correct), ("count", out.step_count), ("accept", out.step_accept),
                     ("eligible", out.step_eligible)):
            tot[k] = [a + b for a, b in zip(tot[k], v)]
        if tally is not None:
            tally.add(out.row_position, out.row_eligible, out.row_accepted)
        loss_sum += float(out.loss)
        n_batches += 1
    head.train()
    summary = acceptance_summary(tot["correct"], tot["count"], tot["accept"], tot["eligible"])
    summary["loss"] = loss_sum / max(1, n_batches)
    if tally is not None:
        summary["by_position"] = tally.summary(limit=max_len)
    return summary


def rounded(summary: dict) -> dict:
    """An evaluation summary with floats (and lists of floats) rounded to 4 decimals, for head.json and logs."""
    def r(v):
        if isinstance(v, float):
            return round(v, 4)
        if isinstance(v, list):
            return [r(x) for x in v]
        return {k: r(x) for k, x in v.items()} if isinstance(v, dict) else v

    return r(summary)


# ---- run state --------------------------------------------------------------------------------------
def save_run_state(run_dir: Path, head, opt, state: RunState, cfg: TrainHeadConfig, extra: dict) -> None:
    """Replace ``run_dir/state`` atomically (atomic.staging_dir) with the head, optimizer and run state."""
    with staging_dir(run_dir / "state", overwrite=True) as d:
        write_state(d, head, opt, {"state": state.__dict__, "recipe": cfg.model_dump(), **extra})


def load_run_state(run_dir: Path, target: Target):
    return read_state(run_dir / "state", target)


def lr_at(step: int, total_steps: int, cfg: TrainHeadConfig) -> float:
    """The recipe's learning rate at `step` (trainer.step.WarmupCosine)."""
    return cfg.schedule(total_steps)(step)


def shuffled(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 1000003 + epoch).shuffle(order)
    return order


# ---- the loop -------------------------------------------------------------------------------------
def estimate_total_steps(cfg: TrainHeadConfig, examples, token_budget: int | None = None) -> int:
    """Steps the loop will take to see `token_budget` tokens (default cfg.token_budget) of `examples`."""
    mean_len = sum(min(len(e.input_ids), cfg.max_len) for e in examples) / max(1, len(examples))
    per_batch = max(1, int(cfg.batch_tokens // max(1.0, mean_len))) * mean_len * 0.85
    return max(1, int((cfg.token_budget if token_budget is None else token_budget) / per_batch))


def loop_schedule(cfg: TrainHeadConfig, budget: Budget, examples: Sequence[TokenizedExample],
                  seconds_run: Callable[[], float]) -> Schedule:
    """The recipe's warmup + cosine, decaying over the budget's tokens (estimated steps) or its seconds."""
    if budget.decay_over == "seconds":
        return WallClockCosine(lr=cfg.lr, budget_s=budget.seconds, seconds_run=seconds_run,
                               warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio)
    return cfg.schedule(estimate_total_steps(cfg, examples, budget.tokens))


def _eval_record(state: RunState, summary: dict) -> dict:
    """One entry of the run's history (held-out acceptance at this point of the run)."""
    return {"step": state.step, "tokens": state.tokens, "elapsed_s": round(state.elapsed_s, 1),
            "alpha": [round(a, 4) for a in summary["alpha"]],
            "accept_length": round(summary["accept_length"], 4), "loss": round(summary["loss"], 4)}


class _Progress:
    """The tqdm bar: tokens, loss, recent per-step top-1 agreement (EWMA), lr, grad norm."""

    def __init__(self, cfg: TrainHeadConfig, total_tokens: int | None, initial_tokens: int, enabled: bool) -> None:
        from tqdm import tqdm

        initial = initial_tokens if total_tokens is None else min(initial_tokens, total_tokens)
        self.bar = tqdm(total=total_tokens, initial=initial, unit="tok", unit_scale=True, disable=not enabled,
                        dynamic_ncols=True, desc="train-head")
        self.correct, self.count = [0.0] * cfg.ttt_steps, [0.0] * cfg.ttt_steps

    def update(self, s: StepStats) -> None:
        self.correct = [0.97 * a + b for a, b in zip(self.correct, s.step_correct)]
        self.count = [0.97 * a + b for a, b in zip(self.count, s.step_count)]
        acc = [c / n if n else 0.0 for c, n in zip(self.correct, self.count)]
        self.bar.update(s.tokens)
        self.bar.set_postfix(loss=f"{s.loss:.3f}", acc=" ".join(f"{a:.2f}" for a in acc[:4]), lr=f"{s.lr:.1e}",
                             gn=f"{s.grad_norm:.2f}")

    def close(self) -> None:
        self.bar.close()


# ---- the step: in this process, or sequence parallel on a Ray Train worker group ----------------------
class InProcessStep:
    """Each update here: one target forward per batch (make_ttt_batch), then trainer.step.train_step."""

    def __init__(self, cfg: TrainHeadConfig, target: Target, head: Eagle3DraftHead, opt: torch.optim.Optimizer,
                 schedule: Schedule, generator: torch.Generator) -> None:
        self.cfg, self.target, self.head, self.opt = cfg, target, head, opt
        self.schedule, self.step_cfg, self.generator = schedule, cfg.step_config(), generator

    def __call__(self, exs: Sequence[TokenizedExample], step: int) -> StepStats:
        batch = make_ttt_batch(self.target, self.head, exs, self.cfg.max_len)
        return train_step(self.head, batch, self.opt, self.schedule, self.step_cfg, step=step,
                          generator=self.generator)

    def sync(self) -> None:
        """The local head is the trained one."""

    def close(self) -> None:
        """Nothing to release."""


def traffic_rows(exs: Sequence[TokenizedExample], max_len: int) -> list[TrafficRow]:
    """Examples as training rows without captured features (each worker regenerates its own), truncated as
    collate() truncates them."""
    return [TrafficRow(e.id, e.domain, tuple(e.input_ids[:max_len]), tuple(e.loss_mask[:max_len]), None, None)
            for e in exs]


def worker_target(cfg: TrainHeadConfig, target: Target) -> Callable[[], Target]:
    """How each worker loads its copy of `target` (a picklable callable): cfg.target, at the loop's target's
    aux layers, dtype and device type."""
    return functools.partial(load_target, cfg.target, device=target.device.type, dtype=target.dtype,
                             aux_layer_ids=tuple(target.aux_layer_ids), purpose="train")


def start_local_ray() -> bool:
    """Start a local Ray with this machine's CPUs unless one is running; True when this call started it."""
    import ray

    if ray.is_initialized():
        return False  # someone else's Ray (the stack, tests): used, never shut down
    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _system_config={"worker_niceness": 0})
    return True


class SequenceParallelStep:
    """Each update on `cfg.sequence_parallel` Ray Train workers (trainer.scaleout.DataParallelStep with
    split="positions"): every worker gets the batch's rows, regenerates the target's features and trains its
    position shard of every row; the gradients are summed, so every worker holds the one-process update.
    The workers hold the trained head: `sync` pulls its weights and optimizer state into the local ones."""

    def __init__(self, cfg: TrainHeadConfig, head: Eagle3DraftHead, opt: torch.optim.Optimizer,
                 schedule: Schedule, *, storage: Path, device: str,
                 target_builder: Callable[[], Target], log: Callable[[str], None]) -> None:
        import ray

        from trainer.scaleout import DataParallelStep

        if head.cfg.num_experts > 1:
            raise ValueError(moe_refusal(cfg.sequence_parallel, head.cfg.num_experts) + " (the head being trained "
                             f"is MoE-routed although the recipe's num_experts is {cfg.num_experts})")
        self.cfg, self.head, self.opt, self.schedule, self.step_cfg = cfg, head, opt, schedule, cfg.step_config()
        self.ray_owned = start_local_ray()
        self.group = None
        self.stale = False
        try:
            share = float(ray.cluster_resources().get("CPU", 1.0)) / cfg.sequence_parallel
            cpus = float(int(share)) if share >= 1 else share
            self.group = DataParallelStep(cfg.sequence_parallel, device=device, storage=storage,
                                          target_builder=target_builder, cpus_per_worker=cpus, name="train-head-seqpar",
                                          split="positions")
            self.group.load(head, opt, cfg.lr, cfg.weight_decay)
        except BaseException:
            self.close()
            raise
        log(f"sequence-parallel step on {cfg.sequence_parallel} Ray Train workers ({cpus:g} CPUs each; rows split "
            "by position, ring attention)")

    def __call__(self, exs: Sequence[TokenizedExample], step: int) -> StepStats:
        rows = traffic_rows(exs, self.cfg.max_len)
        stats, _, _ = self.group.step(rows, step, self.schedule(step), self.step_cfg)
        self.stale = True
        return stats

    def sync(self) -> None:
        """Bring the local head and optimizer level with the workers' (before evaluation, checkpoints, the end)."""
        if not self.stale:
            return
        state = self.group.state()
        self.head.load_state_dict({**state["state"], "embed_tokens.weight": self.head.embed_tokens.weight.detach()})
        self.opt.load_state_dict(state["optimizer"])
        self.stale = False

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.ray_owned:
            import ray

            ray.shutdown()
            self.ray_owned = False


def train_loop(
    cfg: TrainHeadConfig,
    run_dir: Path,
    target: Target,
    head: Eagle3DraftHead,
    train_examples: Sequence[TokenizedExample],
    eval_examples: Sequence[TokenizedExample],
    *,
    state: RunState | None = None,
    opt_tensors: dict | None = None,
    opt_meta: dict | None = None,
    extra: dict | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    target_builder: Callable[[], Target] | None = None,
    budget: Budget | None = None,
    cadence: Cadence | None = None,
    on_checkpoint: Callable[[RunState], None] | None = None,
) -> tuple[RunState, dict]:
    """Train `head` on the device of `target` (where the head must already be) until the budget (default
    Budget.of(cfg): the token or time budget); evaluate and checkpoint the run state at the cadence (default
    Cadence.of(cfg)), calling `on_checkpoint(state)` after each periodic checkpoint (the head is then the
    trained one). Returns the final state and the last held-out evaluation (made after the loop; its run state
    is saved last). Each update is trainer.step.train_step, in this process or (cfg.sequence_parallel > 1) on a
    Ray Train worker group, started here (with a local Ray when none is running) and closed at the end.
    target_builder: how a worker loads its copy of `target` (a picklable callable; default: worker_target)."""
    if not train_examples:
        raise ValueError("train_loop: no training examples")
    run_dir.mkdir(parents=True, exist_ok=True)
    state = state or RunState(history=[])
    state.history = state.history or []
    extra = extra or {}
    clock = RunClock(state)
    budget = budget or Budget.of(cfg)
    opt = _optimizer(cfg, head, opt_tensors, opt_meta)
    schedule = loop_schedule(cfg, budget, train_examples, clock.seconds)
    eval_cache = exact_batches(target, head, eval_examples, cfg.max_len, cfg.batch_tokens)
    head.train()
    step = _open_step(cfg, run_dir, target, head, opt, schedule, state, target_builder, log)

    def held_out() -> dict:
        step.sync()
        return evaluate(head, target, eval_examples, steps=cfg.ttt_steps, bf16=cfg.bf16, cached=eval_cache)

    def checkpoint() -> None:
        step.sync()
        save_run_state(run_dir, head, opt, state, cfg, extra)

    try:
        _Loop(cfg, state, clock, budget, cadence or Cadence.of(cfg), step, held_out, checkpoint, on_checkpoint,
              log).run(train_examples, progress)
        last_eval = held_out()
        state.history.append(_eval_record(state, last_eval))
        checkpoint()
    finally:
        step.close()
    return state, last_eval


def _optimizer(cfg: TrainHeadConfig, head: Eagle3DraftHead, opt_tensors: dict | None,
               opt_meta: dict | None) -> torch.optim.Optimizer:
    """The recipe's AdamW over the head, with a resumed run's optimizer state when there is one."""
    opt = adamw(head, cfg.lr, cfg.weight_decay)
    if opt_tensors is not None:
        restore_optimizer(opt, opt_tensors, opt_meta)
    return opt


def _open_step(cfg: TrainHeadConfig, run_dir: Path, target: Target, head: Eagle3DraftHead,
               opt: torch.optim.Optimizer, schedule: Schedule, state: RunState,
               target_builder: Callable[[], Target] | None,
               log: Callable[[str], None]) -> InProcessStep | SequenceParallelStep:
    """The step function of this run: in this process, or sequence parallel on cfg.sequence_parallel workers."""
    if cfg.sequence_parallel > 1:
        return SequenceParallelStep(cfg, head, opt, schedule, storage=run_dir / "ray-train",
                                    device=target.device.type,
                                    target_builder=target_builder or worker_target(cfg, target), log=log)
    return InProcessStep(cfg, target, head, opt, schedule, torch.Generator().manual_seed(cfg.seed * 7919 + state.step))


@dataclass(eq=False)
class _Loop:
    """The loop's body: batches in epochs until the budget; after each update, held-out evaluation and a checkpoint
    when the cadence says so (then `on_checkpoint(state)`)."""

    cfg: TrainHeadConfig
    state: RunState
    clock: RunClock
    budget: Budget
    cadence: Cadence
    step: InProcessStep | SequenceParallelStep
    held_out: Callable[[], dict]
    checkpoint: Callable[[], None]
    on_checkpoint: Callable[[RunState], None] | None
    log: Callable[[str], None]

    def done(self) -> bool:
        return self.budget.reached(self.state, self.clock.seconds())

    def run(self, examples: Sequence[TokenizedExample], progress: bool) -> None:
        self.tokens0 = self.state.tokens
        self.bar = _Progress(self.cfg, self.budget.tokens, self.state.tokens, progress)
        self.clock.start()
        self.evals, self.checkpoints = Every(self.cadence.eval_seconds), Every(self.cadence.checkpoint_seconds)
        try:
            while not self.done():
                self._epoch(examples)
        finally:
            self.bar.close()

    def _epoch(self, examples: Sequence[TokenizedExample]) -> None:
        """The rest of this epoch (from a resumed run's cursor) until the budget; a finished epoch moves on."""
        state = self.state
        order = shuffled(len(examples), self.cfg.seed, state.epoch)
        resume_from = state.cursor  # windows before this were consumed before a resume
        for cursor, exs in batches(examples, order, self.cfg.batch_tokens, self.cfg.max_len):
            if cursor < resume_from:
                continue
            self._update(exs, cursor)
            if self._eval_due():
                self._evaluate()
            if self.checkpoints.due():
                self._checkpoint()
            if self.done():
                return
        state.epoch += 1
        state.cursor = 0

    def _update(self, exs: Sequence[TokenizedExample], cursor: int) -> None:
        stats = self.step(exs, self.state.step)
        self.state.step += 1
        self.state.tokens += stats.tokens
        self.state.cursor = cursor
        self.state.skipped += int(stats.skipped)
        self.clock.tick()
        self.bar.update(stats)
        if stats.skipped:
            self.log(f"[warn] step {stats.step}: non-finite gradient norm {stats.grad_norm}; update skipped")

    def _eval_due(self) -> bool:
        every = self.cadence.eval_steps
        return bool(every and self.state.step % every == 0) or self.evals.due()

    def _evaluate(self) -> None:
        state, summary = self.state, self.held_out()
        state.history.append(_eval_record(state, summary))
        rate = (state.tokens - self.tokens0) / max(1e-9, self.clock.seconds())
        self.log(f"[eval] step {state.step} tokens {state.tokens} "
                 f"alpha {' '.join(f'{a:.3f}' for a in summary['alpha'])} "
                 f"accept_len {summary['accept_length']:.3f} ({rate:.0f} tok/s)")
        self.evals.reset()

    def _checkpoint(self) -> None:
        self.checkpoint()
        if self.on_checkpoint is not None:
            self.on_checkpoint(self.state)
        self.checkpoints.reset()
