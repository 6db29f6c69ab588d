"""Context-position buckets: acceptance sliced by where in the context a draft is made.

Owns: the per-bucket tally of TTT chain rows (trainer.ttt's row_position / row_eligible / row_accepted).
The bucket edges (0-512, 512-1k, 1-2k, 2-4k, 4-8k by default), their labels and checks live in
adaptive_eagle.positions (torch-free, shared with serving and the policy) and are re-exported here.
The replay's slice (trainer.replay.ReplayScore.by_position) buckets its verify steps here too.

Position: the index in the context of the token a step's first draft predicts, i.e. how many
tokens precede it (a TTT chain row starting at t drafts x_{t+2}: position t + 2; a replay verify
step rooted at the committed token r drafts r + 1: position r + 1). Bucket i holds positions
edges[i] <= p < edges[i + 1]; positions at or past the last edge fall in an open bucket
("8k+"). Must not touch models or data.
"""

from __future__ import annotations

from typing import Sequence

import torch

from adaptive_eagle.positions import (DEFAULT_EDGES, bucket_label, bucket_of, buckets_below, check_edges,
                                      parse_edges)
from trainer.ttt import acceptance_summary


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
