"""Anytime-valid bounds: confidence sequences, which hold at every sample size at once. A gate may look after
every request and stop as soon as a bound decides, and its error rate stays at most alpha however often it
looks (each bound is a test martingale that is at least 1/alpha with probability at most alpha, ever: Ville's
inequality). A fixed-sample interval (the bootstrap of ``policies.gates``) looked at after every sample would
err far more often than its level says.

Owns: the one-sided quantile bounds the sequential gates use. Must not touch: decisions, configs, the clock.

- ``quantile_bound``: the q-quantile of any distribution (ties and discrete values included), from order
  statistics whose rank comes from a test martingale for a Bernoulli(q) mean (a uniform mixture over the
  alternative side; Howard & Ramdas, "Sequential estimation of quantiles", 2022, build theirs the same way).

Distribution-free: no range to assume (accept length and time per token have none that is tight), and the
median's bound resolves a difference of a few tens of percent in a few dozen samples. (A betting bound on the
mean needs the values' range; at a loose range, [1, 16] for accept length, it took hundreds of samples to see
a 25% drop.) Samples come in arrival order.
"""

from __future__ import annotations

import bisect
from functools import lru_cache
from typing import Literal, Sequence

import numpy as np
from scipy.special import betainc, betaln

Side = Literal["lower", "upper"]


def _check(alpha: float, side: str) -> None:
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if side not in ("lower", "upper"):
        raise ValueError(f"side must be 'lower' or 'upper', got {side!r}")


def quantile_bound(x: Sequence[float], q: float, alpha: float, side: Side = "lower") -> float:
    """A one-sided bound on the q-quantile of i.i.d. values, valid at every sample size at once and running
    (the tightest bound any prefix of the samples gave, so a decision it allowed once stays allowed). Lower:
    P(ever, bound > Q(q)) <= alpha; -inf until the samples can exclude anything. Upper: the mirror image,
    +inf until then. Ties and discrete values are allowed (the bound is then conservative)."""
    path = quantile_bound_path(x, q, alpha, side)
    return float(path[-1]) if len(path) else (float("-inf") if side == "lower" else float("inf"))


def quantile_bound_path(x: Sequence[float], q: float, alpha: float, side: Side = "lower") -> np.ndarray:
    """`quantile_bound` after each sample (element t-1: the bound on the first t samples), in one pass."""
    _check(alpha, side)
    if not 0 < q < 1:
        raise ValueError(f"q must be in (0, 1), got {q}")
    v = np.asarray(x, dtype=float)
    if side == "upper":
        return -quantile_bound_path(-v, 1.0 - q, alpha, "lower")
    out = np.empty(len(v))
    best = float("-inf")
    seen: list[float] = []
    for t, value in enumerate(v, start=1):
        bisect.insort(seen, float(value))
        k = rejecting_count(t, q, alpha)
        if k >= 0:  # every value with at most k samples at or below it lies under Q(q): Q(q) >= seen[k]
            best = max(best, seen[k])
        out[t - 1] = best
    return out


@lru_cache(maxsize=None)
def rejecting_count(t: int, q: float, alpha: float) -> int:
    """The largest count s (of t samples at or below a value x) at which the test martingale for
    "P(X <= x) >= q" reaches 1/alpha; -1 when none does. The martingale is a uniform mixture over the
    alternative r in (0, q): M(s) = integral_0^q (r/q)^s ((1-r)/(1-q))^(t-s) dr / q, which falls as s grows
    (and stays under 1 at s = t), so the counts that reject are 0..k."""
    def log_m(s: int) -> float:
        a, b = s + 1.0, t - s + 1.0
        mass = betainc(a, b, q)
        if mass <= 0:
            return float("-inf")
        return float(betaln(a, b) + np.log(mass) - np.log(q) - s * np.log(q) - (t - s) * np.log1p(-q))

    threshold = np.log(1 / alpha)
    if log_m(0) < threshold:
        return -1
    lo, hi = 0, t  # log_m(lo) >= threshold > log_m(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if log_m(mid) >= threshold else (lo, mid)
    return lo


__all__ = ["quantile_bound", "quantile_bound_path", "rejecting_count"]
