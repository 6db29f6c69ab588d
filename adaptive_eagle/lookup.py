"""Model-free drafts: continuations of the longest suffix match in the request's own context
(prompt lookup / suffix matching). Agent and code traffic repeats itself (tool-call JSON, quoted
context, edited code), and these drafts cost no model call.

Owns: pure functions over token lists, and the acceptance bookkeeping that splits a tree's node
budget between model-free and EAGLE branches. Must not touch: models, caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


SOURCES = ("eagle", "lookup", "suffix")  # the draft head, the request's own context, recent outputs


@dataclass
class BudgetSplit:
    """Splits the per-step node budget between the draft head ("eagle") and the model-free sources
    ("lookup": the request's own context; "suffix": recently served outputs) by measured acceptance:
    an exponential moving average of accepted tokens per offered node for each source. Each
    model-free source gets a share in [min_share, max_share] of the budget; the head gets the rest."""

    rates: dict = field(default_factory=lambda: {s: 0.5 for s in SOURCES})
    decay: float = 0.9
    min_share: float = 0.1
    max_share: float = 0.75

    def allocate(self, budget: int, available: dict[str, int]) -> dict[str, int]:
        """Nodes per model-free source (at most what it has), and for "eagle" what is left (>= 1)."""
        offered = {s: n for s, n in available.items() if s != "eagle" and n > 0}
        total = self.rates["eagle"] + sum(self.rates[s] for s in offered)
        out = {}
        for s, n in offered.items():
            share = min(self.max_share, max(self.min_share, self.rates[s] / max(1e-6, total)))
            out[s] = min(n, max(1, round(share * budget)))
        out["eagle"] = max(1, budget - sum(out.values()))
        return out

    def update(self, offered: dict[str, int], accepted: dict[str, int]) -> None:
        for s, n in offered.items():
            if n:
                self.rates[s] = self.decay * self.rates[s] + (1 - self.decay) * accepted.get(s, 0) / n
