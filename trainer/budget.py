"""When an offline training run stops, evaluates and checkpoints, and the wall time it measures that by.

Owns: ``Budget`` (tokens, seconds, steps: the first limit reached stops the loop; what the learning rate's
cosine spans), ``Cadence`` (held-out evaluation every N steps or seconds, a checkpoint every N seconds),
``RunClock`` (one call of the loop's wall time, kept in the run state) and ``Every`` (a wall-clock cadence).
Plain values read by trainer.offline's loop; must not touch: heads, targets, batches, devices, files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from trainer.offline import RunState, TrainHeadConfig


@dataclass(frozen=True)
class Budget:
    """When the loop stops: at the first limit reached (None: no limit of that kind). `decay_over`: what the
    learning rate's cosine spans, the token budget (as estimated steps, trainer.step.WarmupCosine) or the seconds
    (wall time, trainer.step.WallClockCosine)."""

    tokens: int | None  # training tokens seen by the run (RunState.tokens)
    seconds: float | None = None  # wall time of this call of the loop (a resumed run's earlier time excluded)
    steps: int | None = None  # optimizer steps taken by the run (RunState.step)
    decay_over: Literal["tokens", "seconds"] = "tokens"

    def __post_init__(self) -> None:
        if self.tokens is None and self.seconds is None and self.steps is None:
            raise ValueError("a budget needs a limit: tokens, seconds or steps")
        for name in ("tokens", "seconds", "steps"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"budget {name} {value} must be > 0")
        if self.decay_over not in ("tokens", "seconds") or getattr(self, self.decay_over) is None:
            raise ValueError(f"decay_over {self.decay_over!r} needs a budget of {self.decay_over}")

    @classmethod
    def of(cls, cfg: TrainHeadConfig, *, steps: int | None = None,
           decay_over: Literal["tokens", "seconds"] = "tokens") -> "Budget":
        """The recipe's budget: cfg.token_budget, cfg.time_budget_min (in seconds), and `steps`."""
        seconds = cfg.time_budget_min * 60 if cfg.time_budget_min else None
        return cls(tokens=cfg.token_budget, seconds=seconds, steps=steps, decay_over=decay_over)

    def reached(self, state: RunState, seconds_run: float) -> bool:
        return ((self.tokens is not None and state.tokens >= self.tokens)
                or (self.seconds is not None and seconds_run >= self.seconds)
                or (self.steps is not None and state.step >= self.steps))


@dataclass(frozen=True)
class Cadence:
    """When the loop scores its held-out set and checkpoints its run state (None: not by that measure)."""

    eval_steps: int | None = None  # every this many steps (RunState.step a multiple of it)
    eval_seconds: float | None = None  # once this much wall time has passed since the last evaluation
    checkpoint_seconds: float = 300.0  # once this much wall time has passed since the last checkpoint

    def __post_init__(self) -> None:
        if self.eval_steps is not None and self.eval_steps < 1:
            raise ValueError(f"eval_steps {self.eval_steps} must be >= 1 or None")
        for name in ("eval_seconds", "checkpoint_seconds"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} {value} must be >= 0")

    @classmethod
    def of(cls, cfg: TrainHeadConfig) -> "Cadence":
        """The recipe's cadence: every cfg.eval_every steps, a checkpoint every cfg.checkpoint_minutes."""
        return cls(eval_steps=cfg.eval_every, checkpoint_seconds=cfg.checkpoint_minutes * 60)


class RunClock:
    """Wall time of one call of the loop, kept in the run state: RunState.elapsed_s counts on from a resumed
    run's, `seconds()` is this call's share as of the last step (what the budget and a wall-clock schedule read)."""

    def __init__(self, state: RunState) -> None:
        self.state, self.elapsed0, self.t_start = state, state.elapsed_s, time.time()

    def start(self) -> None:
        self.t_start = time.time()

    def tick(self) -> None:
        self.state.elapsed_s = self.elapsed0 + time.time() - self.t_start

    def seconds(self) -> float:
        return self.state.elapsed_s - self.elapsed0


class Every:
    """A wall-clock cadence: due once `seconds` have passed since the start or the last reset (None: never)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds, self.last = seconds, time.time()

    def due(self) -> bool:
        return self.seconds is not None and time.time() - self.last >= self.seconds

    def reset(self) -> None:
        self.last = time.time()
