"""One TTT training step, shared by every training loop (offline `train-head`, the near-line trainer).

Owns: the optimizer every loop builds for a head (``adamw``), the learning-rate schedules
(``WarmupCosine`` over steps, ``WallClockCosine`` over a budget of seconds, one cosine ``cosine_lr``),
what one step needs to know (``StepConfig``), and the step itself (``train_step``: schedule → TTT
loss under autocast → backward → clip → optimizer step), which returns a frozen ``StepStats``. Must not touch: data loading, batching, target forwards, progress
bars, evaluation, checkpoints, devices (the step runs where the head and the batch already are;
autocast takes its device type from the batch's tensors, never a hard-coded "cpu" or "cuda").

Vocabulary: a *step* is one optimizer update on one ``TTTBatch``; the *TTT steps* inside it are
the unrolled draft steps of the loss (``ttt_steps``, see ttt.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from adaptive_eagle.draft_head import Eagle3DraftHead
from trainer.ttt import DEFAULT_STEP_DECAY, DEFAULT_TTT_STEPS, TTTBatch, TTTOutput, ttt_loss

ADAMW_BETAS = (0.9, 0.95)

Schedule = Callable[[int], float]  # optimizer step index (0-based) -> learning rate


@dataclass(frozen=True)
class StepConfig:
    """What one training step needs to know (a loop's recipe projects onto this)."""

    ttt_steps: int = DEFAULT_TTT_STEPS  # unrolled draft steps in the loss
    step_decay: float = DEFAULT_STEP_DECAY  # weight of TTT step j is step_decay**j
    max_loss_rows: int | None = 1024  # chains unrolled and scored per batch (None: all)
    grad_clip: float = 1.0  # max global gradient norm
    bf16: bool = False  # bf16 autocast on the batch's device

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps {self.ttt_steps} must be >= 1")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"step_decay {self.step_decay} must be in (0, 1]")
        if self.max_loss_rows is not None and self.max_loss_rows < 1:
            raise ValueError(f"max_loss_rows {self.max_loss_rows} must be >= 1 or None")
        if not self.grad_clip > 0:
            raise ValueError(f"grad_clip {self.grad_clip} must be > 0")


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warmup to `lr` over `warmup_steps`, then cosine decay to `lr * min_lr_ratio` at `total_steps`
    (held there afterwards)."""

    lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return cosine_lr(self.lr, self.min_lr_ratio, progress)


@dataclass(frozen=True)
class WallClockCosine:
    """Linear warmup to `lr` over `warmup_steps`, then cosine decay to `lr * min_lr_ratio` as the run's wall time
    `seconds_run()` reaches `budget_s` (held there afterwards): for a run bounded by time, whose step count is not
    known in advance."""

    lr: float
    budget_s: float
    seconds_run: Callable[[], float]  # wall time the run has trained so far
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        return cosine_lr(self.lr, self.min_lr_ratio, min(1.0, max(0.0, self.seconds_run() / self.budget_s)))


def cosine_lr(lr: float, min_lr_ratio: float, progress: float) -> float:
    """The cosine both schedules share: `lr` at progress 0, `lr * min_lr_ratio` at progress 1."""
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class StepStats:
    """What one step did (plain Python numbers: the loop logs and aggregates them)."""

    step: int  # index of this optimizer step (the schedule's argument)
    lr: float  # learning rate applied
    loss: float  # weighted TTT loss (+ router aux loss, + extra_loss)
    grad_norm: float  # global gradient norm before clipping (inf/nan when the step was skipped)
    tokens: int  # real tokens in the batch (sum of lengths)
    step_loss: tuple[float, ...]  # [ttt_steps] mean CE per TTT step
    step_correct: tuple[int, ...]  # [ttt_steps] positions whose draft argmax equals the target's
    step_count: tuple[int, ...]  # [ttt_steps] positions scored per TTT step
    skipped: bool = False  # True: the gradient was not finite, so the parameters were left untouched


def adamw(head: Eagle3DraftHead, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """The optimizer of every training loop: AdamW over the head's trainable parameters."""
    return torch.optim.AdamW(head.trainable_parameters(), lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def train_step(
    head: Eagle3DraftHead,
    batch: TTTBatch,
    optimizer: torch.optim.Optimizer,
    schedule: Schedule | None,
    cfg: StepConfig,
    *,
    step: int,
    generator: torch.Generator | None = None,
    extra_loss: Callable[[], torch.Tensor] | None = None,
    objective: Callable[[TTTBatch], tuple[torch.Tensor, TTTOutput]] | None = None,
    reduce_gradients: Callable[[list[torch.Tensor]], None] | None = None,
) -> StepStats:
    """One optimizer update of `head` on `batch`: lr ← schedule(step) → TTT loss → backward → clip → step.

    `head` and `batch` must be on the same device; autocast (when cfg.bf16) runs on that device's
    type. `schedule` None keeps the optimizer's current lr. `generator` samples the scored chains
    when cfg.max_loss_rows caps them. `objective(batch) -> (loss, TTTOutput)` replaces the TTT loss
    of `head` (trainer/scaleout.py passes its DistributedDataParallel wrapper of the same loss, so
    backward averages the gradients over the workers). `reduce_gradients(params)` runs after backward
    and before clipping (trainer/seqpar.py sums the ranks' shares of the gradient there). A non-finite
    gradient norm skips the update (the parameters and the optimizer state are left as they were) and
    says so in ``StepStats.skipped``: one bad batch of live traffic must not poison a continually
    trained head.
    """
    if schedule is not None:
        set_lr(optimizer, schedule(step))
    device_type = batch.aux.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.bf16):
        if objective is None:
            out = ttt_loss(head, batch, steps=cfg.ttt_steps, decay=cfg.step_decay, max_loss_rows=cfg.max_loss_rows,
                           generator=generator)
            loss = out.loss
        else:
            loss, out = objective(batch)
        if extra_loss is not None:
            loss = loss + extra_loss()
    optimizer.zero_grad(set_to_none=True)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not loss.requires_grad:  # the batch scores no position: nothing to learn, the parameters stay as they are
        return StepStats(step=step, lr=float(optimizer.param_groups[0]["lr"]), loss=float(loss), grad_norm=0.0,
                         tokens=int(batch.lengths.sum()), step_loss=tuple(out.step_loss),
                         step_correct=tuple(out.step_correct), step_count=tuple(out.step_count))
    loss.backward()
    if reduce_gradients is not None:
        reduce_gradients(params)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
    skipped = not math.isfinite(grad_norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return StepStats(step=step, lr=float(optimizer.param_groups[0]["lr"]), loss=float(loss.detach()),
                     grad_norm=grad_norm, tokens=int(batch.lengths.sum()), step_loss=tuple(out.step_loss),
                     step_correct=tuple(out.step_correct), step_count=tuple(out.step_count), skipped=skipped)


__all__ = ["ADAMW_BETAS", "Schedule", "StepConfig", "StepStats", "WallClockCosine", "WarmupCosine", "adamw",
           "cosine_lr", "set_lr", "train_step"]
