"""Checkpointing: the near-line trainer's resume state on disk, written whole or not at all, and read back.

Owns: the layout of `<work_dir>/state`: the head and its optimizer (trainer/state.py's files) with a meta
holding what a restarted trainer needs to carry on (the champion it fine-tunes, its counters, the replay
buffer's per-domain counts and priority keys, the tokens at the last candidate, the request ids already
used, MoE growth), and the pool file (the replay buffer's payloads and the held-out records, encoded with
the store's codec). A checkpoint is staged and renamed into place (adaptive_eagle.atomic.staging_dir), so a
crash leaves the old one or the new one. `ResumeState` is that meta and pool as one typed hand-off.

Must not touch: the store (the trainer acks what a checkpoint covers only after `write_checkpoint` returns),
the registry, evidence, the live roles (NearlineTrainer hands their state in and gives it back to them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from adaptive_eagle.atomic import staging_dir
from adaptive_eagle.draft_head import Eagle3DraftHead
from adaptive_eagle.targets import Target
from adaptive_eagle.trace import TraceRecord
from feature_store.schema import decode_record, encode_record
from trainer.state import POOL_FILE, read_pool, read_state, restore_optimizer, write_pool, write_state

STATE = "state"  # the checkpoint's directory under the trainer's work_dir


@dataclass(frozen=True)
class ResumeState:
    """What a checkpoint holds besides the head and its optimizer."""
    base: str  # the champion the head is fine-tuned from (a checkpoint of another champion is not resumed)
    counters: dict  # the trainer's counters (records, tokens, steps, skipped, candidates, window, ...)
    tokens_at_candidate: int  # tokens_trained when the last candidate was written
    seen_requests: list[str]  # request ids trained on or held out, oldest first
    moe: dict | None  # MoE growth (None: moe_grow off)
    buffer_seen: dict  # replay buffer: records seen per domain
    buffer_priorities: dict | None  # replay buffer: priority keys (None: a checkpoint from before them)
    replay: list[tuple[str, bytes]]  # replay buffer: (domain, encoded record)
    heldout: list[tuple[str, TraceRecord]]  # held-out pools: (domain, record)


def state_dir(work_dir: Path) -> Path:
    return Path(work_dir) / STATE


def has_checkpoint(work_dir: Path) -> bool:
    return (state_dir(work_dir) / "trainer.json").exists()


def write_checkpoint(work_dir: Path, head: Eagle3DraftHead, opt: torch.optim.Optimizer, state: ResumeState,
                     codec: str) -> None:
    """Write head, optimizer and `state` as `<work_dir>/state`, replacing the last checkpoint atomically."""
    with staging_dir(state_dir(work_dir), overwrite=True) as d:
        meta = {"base": state.base, "counters": state.counters, "buffer_seen": state.buffer_seen,
                "buffer_priorities": state.buffer_priorities, "tokens_at_candidate": state.tokens_at_candidate,
                "saved_at": time.time(), "seen_requests": list(state.seen_requests), "moe": state.moe}
        write_state(d, head, opt, meta)
        heldout = [(dom, encode_record(r, codec)) for dom, r in state.heldout]
        write_pool(d / POOL_FILE, state.replay, heldout)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as read: the head (float32, the target's embedding) and what was saved with it."""
    directory: Path
    head: Eagle3DraftHead
    meta: dict  # trainer.json
    opt_tensors: dict  # the optimizer's moments

    @property
    def base(self) -> str | None:
        return self.meta.get("base")

    def restore_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """Load the saved moments and param groups into `opt` (built over this checkpoint's head)."""
        restore_optimizer(opt, self.opt_tensors, self.meta)

    def resume_state(self) -> ResumeState:
        """The rest of the state: the meta's fields, the pool file read and its held-out records decoded (an
        unreadable pool or a meta without counters raises)."""
        meta = self.meta
        replay, heldout = read_pool(self.directory / POOL_FILE)
        return ResumeState(
            base=meta.get("base"), counters=meta["counters"], tokens_at_candidate=meta.get("tokens_at_candidate", 0),
            seen_requests=meta.get("seen_requests", []), moe=meta.get("moe"), buffer_seen=meta.get("buffer_seen", {}),
            buffer_priorities=meta.get("buffer_priorities"), replay=replay,
            heldout=[(dom, decode_record(p)) for dom, p in heldout])


def read_checkpoint(work_dir: Path, target: Target) -> Checkpoint:
    """The checkpoint in `<work_dir>/state`. Raises OSError, ValueError or KeyError when it cannot be read (the
    trainer then starts from its champion)."""
    d = state_dir(work_dir)
    head, meta, opt_tensors = read_state(d, target)
    return Checkpoint(d, head, meta, opt_tensors)


__all__ = ["Checkpoint", "ResumeState", "STATE", "has_checkpoint", "read_checkpoint", "state_dir",
           "write_checkpoint"]
