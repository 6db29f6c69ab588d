"""Context-position buckets: where in the context a draft is made, in a few coarse buckets, so that acceptance
can be sliced by context length everywhere it is reported (eval-head, replay, the serving metrics, the
policy's guard, the demo's live view).

Owns: the bucket edges (0-512, 512-1k, 1-2k, 2-4k, 4-8k, 8k+ by default), their labels and checks, and the
positions of a decode's verify steps. Must not touch: models, data, I/O. Plain Python only (the policy,
which must not import torch, reads it); trainer.positions re-exports it and adds the TTT tally.

Position: the index in the context of the token a step's first draft predicts, i.e. how many tokens
precede it. A verify step rooted at the committed token r drafts r + 1: the first step of a request with
n prompt tokens is rooted at the token the prefill sampled (index n), so it drafts position n + 1, and each
step moves the root by its accepted drafts plus the bonus token. Bucket i holds positions
edges[i] <= p < edges[i + 1]; positions at or past the last edge fall in an open bucket ("8k+"), so a
slice has exactly len(edges) buckets (bounded label cardinality). A request's *context position* is the
mean position of its generated tokens: prompt tokens + half the generated tokens (it does not depend on
the head that decoded it, so two heads replayed on one record share it).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

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


def bucket_labels(edges: Sequence[int] = DEFAULT_EDGES) -> tuple[str, ...]:
    """Every bucket's label in order, the open one last: ('0-512', '512-1k', '1-2k', '2-4k', '4-8k', '8k+')."""
    check_edges(edges)
    return tuple(bucket_label(lo, hi) for lo, hi in zip(edges, (*edges[1:], None)))


def label_of(position: int, edges: Sequence[int] = DEFAULT_EDGES) -> str:
    """The label of the bucket holding `position` (a negative position is refused)."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    i = bucket_of(position, edges)
    return bucket_label(edges[i], edges[i + 1] if i + 1 < len(edges) else None)


def step_positions(prompt_tokens: int, accepted: Sequence[int]) -> list[int]:
    """Per verify step, the position its first draft predicts, from the prompt length and each step's accepted
    drafts (bonus token not counted): prompt_tokens + 1, then + accepted + 1 per step."""
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
    out, pos = [], prompt_tokens + 1
    for a in accepted:
        out.append(pos)
        pos += a + 1
    return out


def context_position(prompt_tokens: int, generated_tokens: int) -> int:
    """A request's context position: the mean position of its generated tokens (prompt + generated // 2)."""
    if prompt_tokens < 0 or generated_tokens < 0:
        raise ValueError(f"prompt_tokens and generated_tokens must be >= 0, got {prompt_tokens} and "
                         f"{generated_tokens}")
    return prompt_tokens + generated_tokens // 2


__all__ = ["DEFAULT_EDGES", "bucket_label", "bucket_labels", "bucket_of", "buckets_below",
           "check_edges", "context_position", "label_of", "parse_edges", "step_positions"]
