"""Context-position buckets: acceptance sliced by where in the context a draft is made.

Owns: the bucket edges (0-512, 512-1k, 1-2k, 2-4k, 4-8k by default), their labels and checks, and
the per-bucket tally of TTT chain rows (trainer.ttt's row_position / row_eligible / row_accepted).
The replay's slice (trainer.replay.ReplayScore.by_position) buckets its verify steps here too.

Position: the index in the context of the token a step's first draft predicts, i.e. how many
tokens precede it (a TTT chain row starting at t drafts x_{t+2}: position t + 2; a replay verify
step rooted at the committed token r drafts r + 1: position r + 1). Bucket i holds positions
edges[i] <= p < edges[i + 1]; positions at or past the last edge fall in an open bucket
("8k+"). Must not touch models or data.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

import torch

from trainer.ttt import acceptance_summary

DEFAULT_EDGES = (0, 512, 1024, 2048, 4096, 8192)


def parse_edges(text: str) -> tuple[int, ...]:
    """'0,512,1024' -> (0, 512, 1024); ValueError naming the rule unless integers, from 0, increasing."""
    try:
        edges = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"buckets {text!r}: comma-separated integers, e.g. 0,512,1024,2048") from None
    check_edges(edges)
    return edges


def check_edges(edges: Sequence[int]) -> None:
    if len(edges) < 2 or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"buckets {','.join(map(str, edges))}: at least two edges, the first 0, strictly "
                         "increasing (e.g. 0,512,1024,2048,4096,8192)")


def _short(x: int) -> str:
    return f"{x // 1024}k" if x and x % 1024 == 0 else str(x)


def bucket_label(lo: int, hi: int | None) -> str:
    """(512, 1024) -> '512-1k', (1024, 2048) -> '1-2k', (8192, None) -> '8k+'."""
    if hi is None:
        return f"{_short(lo)}+"
    a, b = _short(lo), _short(hi)
    if a.endswith("k") and b.endswith("k"):
        a = a[:-1]
    return f"{a}-{b}"


def bucket_of(position: int, edges: Sequence[int]) -> int:
    """Index of the bucket holding `position` (len(edges) - 1: the open bucket past the last edge)."""
    return bisect_right(edges, position) - 1


def buckets_below(edges: Sequence[int], limit: int) -> list[tuple[int, int | None]]:
    """The buckets (lo, hi; hi None: open) that hold positions < limit."""
    spans = [(lo, hi) for lo, hi in zip(edges, edges[1:]) if lo < limit]
    if limit > edges[-1]:
        spans.append((edges[-1], None))
    return spans


class PositionTally:
    """Per-bucket sums of TTT chain rows: eligible and accepted chains per step (what ttt_loss's
    step_eligible / step_accept sum over every row), and scored start positions."""

    def __init__(self, edges: Sequence[int], steps: int) -> None:
        check_edges(edges)
        self.edges, self.steps = tuple(edges), steps
        self.eligible = torch.zeros(len(edges), steps, dtype=torch.long)  # [buckets + open, steps]
        self.accepted = torch.zeros_like(self.eligible)

    def add(self, row_position: torch.Tensor, row_eligible: torch.Tensor, row_accepted: torch.Tensor) -> None:
        """row_position [N] chain start t; row_eligible / row_accepted [steps, N] bool."""
        pos = (row_position.cpu() + 2).contiguous()  # the token step 0 drafts
        idx = torch.bucketize(pos, torch.tensor(self.edges), right=True) - 1  # [N]
        for name, rows in (("eligible", row_eligible), ("accepted", row_accepted)):
            sums = torch.zeros(len(self.edges), self.steps, dtype=torch.long)
            sums.index_add_(0, idx, rows.cpu().long().T)
            setattr(self, name, getattr(self, name) + sums)

    def summary(self, limit: int) -> list[dict]:
        """One entry per bucket below `limit`: positions (chains with step 0 scored), j-α per step and
        the chain accept length (trainer.ttt.acceptance_summary), with the sums they rest on."""
        out = []
        for i, (lo, hi) in enumerate(buckets_below(self.edges, limit)):
            elig, acc = self.eligible[i].tolist(), self.accepted[i].tolist()
            s = acceptance_summary(acc, elig, acc, elig)
            out.append({"bucket": bucket_label(lo, hi), "start": lo, "end": hi, "positions": elig[0],
                        "alpha": s["alpha"], "accept_length": s["accept_length"], "eligible": elig, "accepted": acc})
        return out


__all__ = ["DEFAULT_EDGES", "PositionTally", "bucket_label", "bucket_of", "buckets_below", "check_edges",
           "parse_edges"]
