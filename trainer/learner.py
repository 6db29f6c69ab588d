"""The near-line trainer's learner: the head being fine-tuned, its optimizer, and one update on a batch.

Owns: the head (float32, on the trainer's device) and its AdamW optimizer, replaced together whenever the
head is (a restart from a champion, a cold start, a grown expert, a resumed checkpoint); turning records into
training rows for this head (trainer.traffic; positions "new": which record first carried each prefix); the
update itself, in this process (trainer.step.train_step,
with MoE routing supervision) or on a data-parallel worker group (trainer.scaleout.DataParallelStep: started
at the first update, given the head whenever it was replaced), under a schedule that is constant after
warmup and the step config (bf16 where the hardware multiplies it natively); and bringing the head level
with the workers' before anyone reads it (`sync`).

Must not touch: the store, the replay buffer, the registry, the state on disk, the trainer's counters.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch

from adaptive_eagle.draft_head import Eagle3DraftHead
from adaptive_eagle.targets import Target, cpu_has_fast_bf16
from adaptive_eagle.trace import TraceRecord
from trainer.config import NearlineConfig
from trainer.moe import MoEGrowth
from trainer.scaleout import DataParallelStep
from trainer.step import StepConfig, StepStats, WarmupCosine, adamw, train_step
from trainer.traffic import PrefixOwners, TrafficRow, make_traffic_batch, row_from_record


class Learner:
    """The head under training and its update. `worker_target`: with cfg.workers > 1, a picklable builder of
    each data-parallel worker's target (None: the workers load the trainer's target by name)."""

    def __init__(self, cfg: NearlineConfig, device: torch.device, work_dir: Path,
                 worker_target: Callable[[], Target] | None, note: Callable[[str], None]) -> None:
        self.cfg, self.device, self.work_dir, self.worker_target, self._note = cfg, device, work_dir, worker_target, note
        self.head: Eagle3DraftHead | None = None
        self.opt: torch.optim.Optimizer | None = None
        # data-parallel update (cfg.workers > 1): the worker group, started at the first update; whether it holds
        # self.head yet, and whether self.head is behind the workers' weights
        self.data_parallel: DataParallelStep | None = None
        self.pushed = self.stale = False
        self.prefixes = PrefixOwners()  # positions "new": which record first carried each prefix (about the traffic,
        # not the head: kept when the head is replaced)

    def set_head(self, head: Eagle3DraftHead | None) -> None:
        """Train `head` from now on (None: no head yet), with a new optimizer over its parameters."""
        self.head = None if head is None else head.to(self.device)
        self.opt = None if head is None else adamw(self.head, self.cfg.lr, self.cfg.weight_decay)
        self.pushed = self.stale = False  # a data-parallel worker group gets this head at the next update

    def rows(self, records: list[TraceRecord]) -> list[TrafficRow]:
        """Training rows of `records` for this head (its aux layers; cfg.positions, cut at cfg.max_len)."""
        return [row_from_record(r, self.head.cfg.aux_layer_ids, self.cfg.positions, self.cfg.max_len, self.prefixes)
                for r in records]

    def update(self, rows: list[TrafficRow], step: int, target: Target, target_spec: str | None,
               moe: MoEGrowth | None) -> tuple[StepStats, int, int]:
        """One optimizer step on `rows`: (stats, real tokens trained, rows whose features came from a target
        forward here). No rows: no update (a batch whose every record was cut before its first trained token).
        target_spec: what the trainer loaded its target from (data-parallel workers load the same)."""
        if not rows:
            stats = StepStats(step=step, lr=float(self.opt.param_groups[0]["lr"]), loss=0.0, grad_norm=0.0, tokens=0,
                              step_loss=(), step_correct=(), step_count=())
            return stats, 0, 0
        if self.cfg.workers > 1:
            return self._update_data_parallel(rows, step, target, target_spec)
        tb = make_traffic_batch(target, self.head, rows, self.device)
        with moe.supervise(self.head, tb) if moe is not None else nullcontext() as extra:
            stats = train_step(self.head, tb.batch, self.opt, self.schedule(), self.step_config(), step=step,
                               extra_loss=extra)
        return stats, tb.tokens, tb.regenerated

    def _update_data_parallel(self, rows: list[TrafficRow], step: int, target: Target,
                              target_spec: str | None) -> tuple[StepStats, int, int]:
        """The update on the worker group (started at the first call; given the head whenever it changed)."""
        if self.data_parallel is None:
            by_position = self.cfg.sequence_parallel > 1
            self.data_parallel = DataParallelStep(
                self.cfg.workers, device=self.device.type, storage=self.work_dir / "ray-train",
                target=target_spec or str(target.path), target_builder=self.worker_target,
                cpus_per_worker=self.cfg.worker_cpus, split="positions" if by_position else "rows")
            self._note(f"sequence-parallel step on {self.cfg.workers} Ray Train workers (rows split by position, "
                       "ring attention)" if by_position else f"data-parallel step on {self.cfg.workers} Ray Train "
                       "workers (DDP)")
        if not self.pushed:
            self.data_parallel.load(self.head, self.opt, self.cfg.lr, self.cfg.weight_decay)
            self.pushed = True
        out = self.data_parallel.step(rows, step, self.schedule()(step), self.step_config())
        self.stale = True
        return out

    def sync(self) -> None:
        """Bring self.head (and the optimizer's moments) level with the workers' after data-parallel updates."""
        if not self.stale or self.data_parallel is None:
            return
        state = self.data_parallel.state()
        weights = {**state["state"], "embed_tokens.weight": self.head.embed_tokens.weight.detach()}
        self.head.load_state_dict(weights)
        self.opt.load_state_dict(state["optimizer"])
        self.stale = False

    def schedule(self) -> WarmupCosine:
        # constant after warmup: traffic never ends, so there is no horizon to decay towards
        return WarmupCosine(lr=self.cfg.lr, total_steps=1, warmup_steps=self.cfg.warmup_steps, min_lr_ratio=1.0)

    def step_config(self) -> StepConfig:
        bf16 = self.cfg.bf16
        if bf16 is None:  # the offline trainer's policy: CUDA, or a CPU that multiplies bf16 in hardware
            bf16 = self.device.type == "cuda" or cpu_has_fast_bf16()
        return StepConfig(ttt_steps=self.cfg.ttt_steps, step_decay=self.cfg.step_decay,
                          max_loss_rows=self.cfg.max_loss_rows, grad_clip=self.cfg.grad_clip, bf16=bf16)

    def close(self) -> None:
        """Stop the data-parallel worker group, if one runs."""
        if self.data_parallel is not None:
            self.data_parallel.close()
            self.data_parallel = None


__all__ = ["Learner"]
