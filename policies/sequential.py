"""Anytime-valid bounds: confidence sequences, which hold at every sample size at once. A gate may look after
every request and stop as soon as a bound decides, and its error rate stays at most alpha however often it
looks (each bound is a test martingale that is at least 1/alpha with probability at most alpha, ever: Ville's
inequality). A fixed-sample interval (the bootstrap of ``policies.gates``) looked at after every sample would
err far more often than its level says.

Owns: the one-sided quantile bounds the sequential gates use. Must not touch: decisions, configs, the clock.

- ``quantile_bound``: the q-quantile of any distribution (ties and discrete values included), from order
  statistics whose rank comes from a test martingale for a Bernoulli(q) mean (a uniform mixture over the
  alternative side; Howard & Ramdas, "Sequential estimation of quantiles", 2022, build theirs the same way).
- ``paired_tail_path``: paired evidence (two heads replayed on the same records, in arrival order): a sign test
  on the records that touch the champion's tail, as two test martingales (the candidate wins such records
  more often than it loses them; it loses them more often), for the sequential offline gate.

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


def sign_log_martingale(wins: int, n: int, side: Literal["wins", "losses"] = "wins") -> float:
    """log M of a test martingale against "P(win) <= 1/2" (side "wins"; "losses": against "P(win) >= 1/2")
    after `wins` wins in `n` non-tied comparisons: a uniform mixture over the alternative p in (1/2, 1) of the
    likelihood ratios (2p)^wins (2(1-p))^(n-wins), each a supermartingale under any p0 <= 1/2, so
    M = 2^(n+1) B(wins+1, n-wins+1) P(Beta(wins+1, n-wins+1) > 1/2). M >= 1/alpha ever has probability <= alpha
    under the null (Ville)."""
    if not 0 <= wins <= n:
        raise ValueError(f"wins must be in [0, n], got {wins} of {n}")
    if side == "losses":
        wins = n - wins
    elif side != "wins":
        raise ValueError(f"side must be 'wins' or 'losses', got {side!r}")
    a, b = wins + 1.0, n - wins + 1.0
    upper = betainc(b, a, 0.5)  # P(Beta(a, b) > 1/2) = I_{1/2}(b, a)
    if upper <= 0:
        return float("-inf")
    return float((n + 1) * np.log(2.0) + betaln(a, b) + np.log(upper))


def tail_thresholds(champion: Sequence[float], q: float) -> np.ndarray:
    """Predictable thresholds: element i is the q-quantile (inverted CDF: an observed value) of the champion's
    first i values (-inf for i = 0: with nothing seen, the first record never touches the tail)."""
    a = np.asarray(champion, dtype=float)
    out = np.full(len(a), -np.inf)
    seen: list[float] = []
    for i, value in enumerate(a):
        if seen:
            out[i] = seen[min(len(seen) - 1, max(0, int(np.ceil(q * len(seen))) - 1))]
        bisect.insort(seen, float(value))
    return out


def paired_tail_path(champion: Sequence[float], candidate: Sequence[float], q: float) -> dict[str, np.ndarray]:
    """The sign test of the sequential offline gate, after each record (element t-1: the first t records).
    Records are pairs (champion's and candidate's accept length on the same record) in arrival order. A record
    *touches the tail* when the lower of its two values is at or under the champion's q-quantile of the records
    before it (a predictable threshold; the first record never touches it). On those records with a
    difference, a win is the candidate higher. The selection depends only on the unordered pair, so for two
    equal heads (either value equally likely to be either head's) each counted record is a fair coin and both
    martingales are test martingales under "the candidate is no better (worse) on the tail".

    Returns arrays: touched (tail records so far), decided (of them, not tied), wins, log_m_wins,
    log_m_losses."""
    a, b = np.asarray(champion, dtype=float), np.asarray(candidate, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired values differ in length: {len(a)} champion, {len(b)} candidate")
    tau = tail_thresholds(a, q)
    touch = np.minimum(a, b) <= tau
    decided = touch & (a != b)
    touched, n, wins = np.cumsum(touch), np.cumsum(decided), np.cumsum(decided & (b > a))
    log_w = np.array([sign_log_martingale(int(w), int(k)) for w, k in zip(wins, n)])
    log_l = np.array([sign_log_martingale(int(w), int(k), "losses") for w, k in zip(wins, n)])
    return {"touched": touched, "decided": n, "wins": wins, "log_m_wins": log_w, "log_m_losses": log_l}


__all__ = ["paired_tail_path", "quantile_bound", "quantile_bound_path", "rejecting_count", "sign_log_martingale",
           "tail_thresholds"]
