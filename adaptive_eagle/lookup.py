"""Model-free drafts: continuations of the longest suffix match in the request's own context
(prompt lookup / suffix matching). Agent and code traffic repeats itself (tool-call JSON, quoted
context, edited code), and these drafts cost no model call.

Owns: pure functions over token lists, and the acceptance bookkeeping that splits a tree's node
budget between model-free and EAGLE branches. Must not touch: models, caches.
"""

from __future__ import annotations

from dataclasses import dataclass


def suffix_match_continuation(context: list[int], max_tokens: int, min_ngram: int = 2, max_ngram: int = 6) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest suffix of `context`
    (length max_ngram down to min_ngram); [] when no suffix of at least min_ngram tokens recurs."""
    n = len(context)
    if max_tokens <= 0 or n < min_ngram + 1:
        return []
    for size in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        suffix = context[n - size:]
        first = suffix[0]
        # scan backwards for the most recent earlier occurrence (not the suffix itself)
        for start in range(n - size - 1, -1, -1):
            if context[start] == first and context[start : start + size] == suffix:
                follow = context[start + size : start + size + max_tokens]
                if follow:
                    return follow
    return []


@dataclass
class BudgetSplit:
    """Splits the per-step node budget between model-free and EAGLE nodes by measured acceptance:
    an exponential moving average of accepted tokens per offered node for each source."""

    lookup_rate: float = 0.5
    eagle_rate: float = 0.5
    decay: float = 0.9
    min_share: float = 0.1
    max_share: float = 0.75

    def lookup_nodes(self, budget: int, available: int) -> int:
        share = self.lookup_rate / max(1e-6, self.lookup_rate + self.eagle_rate)
        share = min(self.max_share, max(self.min_share, share))
        return min(available, max(1, round(share * budget))) if available else 0

    def update(self, lookup_offered: int, lookup_accepted: int, eagle_offered: int, eagle_accepted: int) -> None:
        if lookup_offered:
            self.lookup_rate = self.decay * self.lookup_rate + (1 - self.decay) * lookup_accepted / lookup_offered
        if eagle_offered:
            self.eagle_rate = self.decay * self.eagle_rate + (1 - self.decay) * eagle_accepted / eagle_offered
