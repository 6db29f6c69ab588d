"""Anytime-valid bounds: confidence sequences, which hold at every sample size at once. A gate may look after
every request and stop as soon as a bound decides, and its error rate stays at most alpha however often it
looks (each bound is a test martingale that is at least 1/alpha with probability at most alpha, ever: Ville's
inequality). A fixed-sample interval (the bootstrap of ``policies.gates``) looked at after every sample would
err far more often than its level says.

Owns: the one-sided quantile bounds the sequential gates use. Must not touch: decisions, configs, the clock.

- ``quantile_bound``: the q-quantile of any distribution (ties and discrete values included), from order
  statistics whose rank comes from a test martingale for a Bernoulli(q) mean (a uniform mixture over the
  alternative side; Howard & Ramdas, "Sequential estimation of quantiles", 2022, build theirs the same way).
- ``tail_evidence``: paired evidence (two heads replayed on the same records, in arrival order) about the tail
  statistic itself, for the sequential offline gate: a test martingale against "the candidate's tail is no
  better than the champion's" (and, with the heads swapped, "no worse"). For the lower-tail mean it bets on a
  paired quantity whose mean bounds the tail difference from below, minus an anytime bound on what estimating
  the champion's threshold can cost (`tail_mean_log_evalue_path`); for the quantile it counts the candidate's
  records under an anytime upper bound on the champion's quantile (`quantile_log_evalue_path`). The null each
  controls is the whole composite "not better on the tail", whatever the shape of the change: an equal head and
  every worse one.

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
from scipy.special import betainc, betaln, logsumexp

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


def bernoulli_below_log_martingale(below: int, n: int, q: float) -> float:
    """log M of the test martingale against "P(X_i = 1 | past) >= q" after `below` ones in n indicators: the
    uniform mixture over the alternative r in (0, q) of the likelihood ratios (r/q)^below ((1-r)/(1-q))^(n-below)
    (`rejecting_count` inverts it for one fixed threshold)."""
    if not 0 <= below <= n:
        raise ValueError(f"below must be in [0, n], got {below} of {n}")
    a, b = below + 1.0, n - below + 1.0
    mass = betainc(a, b, q)
    if mass <= 0:
        return float("-inf")
    return float(betaln(a, b) + np.log(mass) - np.log(q) - below * np.log(q) - (n - below) * np.log1p(-q))


@lru_cache(maxsize=None)
def rejecting_count(t: int, q: float, alpha: float) -> int:
    """The largest count s (of t samples at or below a value x) at which the test martingale for
    "P(X <= x) >= q" reaches 1/alpha; -1 when none does. The martingale is a uniform mixture over the
    alternative r in (0, q): M(s) = integral_0^q (r/q)^s ((1-r)/(1-q))^(t-s) dr / q, which falls as s grows
    (and stays under 1 at s = t), so the counts that reject are 0..k."""
    def log_m(s: int) -> float:
        return bernoulli_below_log_martingale(s, t, q)

    threshold = np.log(1 / alpha)
    if log_m(0) < threshold:
        return -1
    lo, hi = 0, t  # log_m(lo) >= threshold > log_m(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if log_m(mid) >= threshold else (lo, mid)
    return lo


def first_bounded(q: float, alpha: float) -> int:
    """The fewest samples at which the one-sided anytime bound on the q-quantile (`quantile_bound`, lower side;
    the upper side is the lower one of 1 - q) is finite: below it the bound can exclude nothing."""
    t = 1
    while rejecting_count(t, q, alpha) < 0:
        t += 1
    return t


def tail_thresholds(champion: Sequence[float], q: float) -> np.ndarray:
    """Predictable thresholds: element i is the q-quantile (inverted CDF: an observed value) of the first i values
    (-inf for i = 0)."""
    a = np.asarray(champion, dtype=float)
    out = np.full(len(a), -np.inf)
    seen: list[float] = []
    for i, value in enumerate(a):
        if seen:
            out[i] = seen[min(len(seen) - 1, max(0, int(np.ceil(q * len(seen))) - 1))]
        bisect.insort(seen, float(value))
    return out


# ---- the tail difference itself: the offline gate's test ----------------------------------------------------
# Multiples of q at which the champion's distribution function is bounded to price the estimated threshold of
# the lower-tail mean (`_gap_bounds`); q itself is bounded on both sides.
BAND_LEVELS = (0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.6, 2.0)
BAND_SHARE = 0.5  # of alpha: the band's bounds together; the rest goes to the test martingale
CAP = 0.9  # a bet is at most CAP of what keeps every factor positive
PENALTY_BET = 0.3  # the bet's estimate of the mean subtracts this share of the predictable gap bound
# the tail-mean test's bets (`tail_mean_log_evalue_path`): (w, weight), betting at the threshold t + w (s - t), t the
# champion's running q-quantile and s the candidate's; the e-value is the weighted average
THRESHOLD_MIX = ((0.0, 0.5), (1.0, 0.5))


Band = list[tuple[float, np.ndarray]]  # (level p, running bound on the p-quantile after each sample)


def _band(x: np.ndarray, q: float, alpha: float) -> tuple[Band, Band]:
    """Running anytime bounds on the quantiles of x at the BAND_LEVELS multiples of q: lower bounds (levels >= q)
    and upper bounds (levels <= q), alpha shared equally among them."""
    levels = sorted({min(0.99, q * m) for m in BAND_LEVELS})
    sides = [(p, "lower") for p in levels if p >= q] + [(p, "upper") for p in levels if p <= q]
    each = alpha / len(sides)
    lows = [(p, quantile_bound_path(x, p, each, "lower")) for p, side in sides if side == "lower"]
    ups = [(p, quantile_bound_path(x, p, each, "upper")) for p, side in sides if side == "upper"]
    return lows, ups


def _gap_bounds(t: np.ndarray, q: float, lows: list[tuple[float, float]], ups: list[tuple[float, float]]) -> np.ndarray:
    """An upper bound on LTM(X) - phi(t) at each threshold t, where phi(t) = t - E[(t - X)+] / q, LTM is the mean
    of X's lowest q share (= max over t of phi, reached at the q-quantile t*) and the band holds: Q(p) >= L_p for
    (p, L_p) in lows, Q(p) <= U_p for (p, U_p) in ups. phi is concave with slope 1 - F(s)/q, so
    LTM - phi(t) = integral from t to t* of (1 - F/q) (t < t*; its mirror for t > t*), and the band bounds F
    on either side: F(s) >= p for s >= U_p, F(s) < p for s < L_p. Infinite while the band cannot bound t*."""
    t = np.asarray(t, dtype=float)
    u_q, l_q = dict(ups)[q], dict(lows)[q]
    if not (np.isfinite(u_q) and np.isfinite(l_q)):
        return np.full(t.shape, np.inf)
    below = np.zeros(t.shape)  # t < t* <= U_q: integrate (1 - F_lo(s)/q)+ over [t, U_q]
    steps = sorted((u, p) for p, u in ups if np.isfinite(u))
    edges = [-np.inf] + [u for u, _ in steps] + [u_q]
    f_lo = np.maximum.accumulate([0.0] + [p for _, p in steps]) if steps else np.array([0.0])
    for k in range(len(edges) - 1):
        lo, hi = edges[k], min(edges[k + 1], u_q)
        height = 1.0 - f_lo[k] / q
        if height > 0 and hi > lo:
            below += height * np.maximum(0.0, hi - np.maximum(t, lo))
    above = np.zeros(t.shape)  # L_q <= t* < t: integrate (F_hi(s)/q - 1)+ over [L_q, t]
    steps = sorted((l, p) for p, l in lows if np.isfinite(l))
    edges = [l for l, _ in steps] + [np.inf]
    levels = [p for _, p in steps]
    for k in range(len(edges) - 1):
        lo, hi = max(edges[k], l_q), edges[k + 1]
        height = min(levels[k + 1:], default=1.0) / q - 1.0  # F(s) < the lowest level whose L_p is above s
        if height > 0 and hi > lo:
            above += height * np.maximum(0.0, np.minimum(t, hi) - lo)
    return np.maximum(below, above)


def _gap_bounds_at(t: np.ndarray, q: float, lows: Band, ups: Band, k: int) -> np.ndarray:
    """`_gap_bounds` with the band as it stood after sample k (index k of each running bound)."""
    return _gap_bounds(t, q, [(p, L[k]) for p, L in lows], [(p, U[k]) for p, U in ups])


def tail_mean_log_evalue_path(champion: Sequence[float], candidate: Sequence[float], q: float, alpha: float,
                              *, floor: float = 1.0, looks: Sequence[int] | None = None) -> np.ndarray:
    """log e-value against "the candidate's lower-tail mean (mean of its lowest q share) is at most the
    champion's", at each look (a record count; every record by default). Paired records in arrival order.

    Why it tests the tail difference itself: for any threshold s, phi_b(s) = s - E[(s - b)+] / q is at most
    LTM(b) (the Rockafellar-Uryasev form: LTM is the max of phi), and LTM(a) = phi_a(t) + gap(t) for any t,
    gap(t) >= 0 (zero at a's q-quantile), so
        LTM(b) - LTM(a) >= E[g] - gap(t),  g = (s - t) + ((t - a)+ - (s - b)+) / q,
    a paired quantity (records the two heads score alike cancel where s = t). t_i is the champion's running
    q-quantile (predictable), gap(t_i) is bounded by `_gap_bounds` from an anytime band on the champion's
    quantiles (BAND_SHARE of alpha), and each betting martingale prod(1 + lambda_i (g_i - c_i)), c_i the bound,
    is a test supermartingale under the null while the band holds (lambda_i predictable and capped so every
    factor stays positive: every value is at least `floor`). The bound of every past record's gap tightens as
    the band does (each look uses the band at that look), which keeps the price of not knowing the champion's
    quantile small.

    Two bets, averaged (THRESHOLD_MIX; an average of test supermartingales is one, so P(ever e >= 1 /
    (BAND_SHARE' alpha)) <= alpha: Ville's inequality plus the band's error):
    - s = t, the champion's threshold: g is (t - a)+ / q less (t - b)+ / q, so its mean can never exceed the
      champion's own tail spread, t - LTM(a), however much better the candidate is. Then a head 1.5x better on
      every record needed as many records as one 1.1x better (148 against 161-170 on real runs' champions,
      docs/results/continual-2026-12-07d-epyc): the band's price had to fall under that spread first.
    - s = the candidate's running q-quantile: g's mean is phi_b(s) - phi_a(t), which grows with the gain.
    Compare with `tail_log_bar(alpha)`: the value to reach."""
    a, b = np.asarray(champion, dtype=float), np.asarray(candidate, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired values differ in length: {len(a)} champion, {len(b)} candidate")
    if len(a) and min(a.min(), b.min()) < floor:
        raise ValueError(f"values must be >= floor {floor}, got {min(a.min(), b.min())}")
    n = len(a)
    looks = list(range(1, n + 1)) if looks is None else [int(m) for m in looks]
    out = np.zeros(len(looks))
    if n == 0:
        return out
    lows, ups = _band(a, q, alpha * BAND_SHARE)
    t, own = tail_thresholds(a, q), tail_thresholds(b, q)
    burn = int(np.ceil(2 / q))  # thresholds from fewer records than this are too rough to bet on
    prev_gap = np.full(n, np.inf)
    for i in range(burn, n):
        prev_gap[i] = _gap_bounds_at(t[i:i + 1], q, lows, ups, i - 1)[0]
    ok = np.isfinite(t) & np.isfinite(own)
    lead = np.zeros(n)
    lead[ok] = own[ok] - t[ok]
    bets = []
    for w, weight in THRESHOLD_MIX:
        s = t + w * lead
        g, reach = np.zeros(n), np.zeros(n)
        g[ok] = (s[ok] - t[ok]) + (np.maximum(t[ok] - a[ok], 0.0) - np.maximum(s[ok] - b[ok], 0.0)) / q
        reach[ok] = np.maximum((s[ok] - floor) / q - (s[ok] - t[ok]), 0.0)  # g >= -reach
        bets.append((weight, g, _bets(g, reach, prev_gap, burn)))
    for j, m in enumerate(looks):
        if m <= burn:
            continue
        idx = np.arange(burn, m)
        gap = np.minimum(_gap_bounds_at(t[idx], q, lows, ups, m - 1), prev_gap[idx])
        logs = []
        for weight, g, lam in bets:
            on = lam[idx] > 0
            logs.append(np.log(weight) + np.log1p(lam[idx][on] * (g[idx][on] - gap[on])).sum())
        out[j] = float(logsumexp(logs))  # log of the weighted average, without overflow
    return out


def _bets(g: np.ndarray, reach: np.ndarray, prev_gap: np.ndarray, burn: int) -> np.ndarray:
    """Predictable bets on g less its gap bound: the running mean (less PENALTY_BET of the bound) over the
    running second moment, capped at CAP of what keeps 1 + lambda (g - gap) positive when g = -reach."""
    lam = np.zeros(len(g))
    total, total_sq, count = 0.0, 0.0, 0
    for i in range(burn, len(g)):
        if count >= 2 and np.isfinite(prev_gap[i]):
            mean = total / count - PENALTY_BET * prev_gap[i]
            var = max(total_sq / count - (total / count) ** 2, 1e-6)
            cap = CAP / (reach[i] + prev_gap[i]) if reach[i] + prev_gap[i] > 0 else 0.0
            lam[i] = float(np.clip(mean / (var + mean * mean), 0.0, cap))
        total, total_sq, count = total + g[i], total_sq + g[i] ** 2, count + 1
    return lam


def quantile_log_evalue_path(champion: Sequence[float], candidate: Sequence[float], q: float, alpha: float,
                             *, looks: Sequence[int] | None = None) -> np.ndarray:
    """log e-value against "the candidate's q-quantile is at most the champion's", at each look. U_i, an anytime
    upper bound on the champion's q-quantile from the records before i (BAND_SHARE of alpha), is at least
    that quantile at every i while it holds; under the null the candidate's quantile is then at most U_i, so
    P(b_i <= U_i | past) >= q, and `bernoulli_below_log_martingale` of the indicators b_i <= U_i is a test
    martingale. Rejecting it says the candidate's q-quantile lies above the champion's."""
    a, b = np.asarray(champion, dtype=float), np.asarray(candidate, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired values differ in length: {len(a)} champion, {len(b)} candidate")
    n = len(a)
    looks = list(range(1, n + 1)) if looks is None else [int(m) for m in looks]
    if n == 0:
        return np.zeros(len(looks))
    upper = quantile_bound_path(a, q, alpha * BAND_SHARE, "upper")
    bound = np.concatenate([[np.inf], upper[:-1]])  # predictable: from the records before
    counted = np.isfinite(bound)
    below = np.cumsum(counted & (b <= bound))
    seen = np.cumsum(counted)
    return np.array([bernoulli_below_log_martingale(int(below[m - 1]), int(seen[m - 1]), q) if m else 0.0
                     for m in looks])


def tail_log_bar(alpha: float) -> float:
    """The log e-value a tail test must reach to be significant at 1 - alpha (the rest went to its band)."""
    return float(np.log(1.0 / (alpha * (1.0 - BAND_SHARE))))


def tail_evidence_path(champion: Sequence[float], candidate: Sequence[float], q: float, alpha: float,
                       statistic: Literal["quantile", "tail_mean"], *, floor: float = 1.0,
                       looks: Sequence[int] | None = None) -> np.ndarray:
    """log e-value against "the candidate is no better on the tail" (config.tail_statistic at q) at each look
    (every record by default); compare with `tail_log_bar(alpha)`. Swap the arguments for "no worse"."""
    if statistic == "tail_mean":
        return tail_mean_log_evalue_path(champion, candidate, q, alpha, floor=floor, looks=looks)
    if statistic == "quantile":
        return quantile_log_evalue_path(champion, candidate, q, alpha, looks=looks)
    raise ValueError(f"statistic must be 'quantile' or 'tail_mean', got {statistic!r}")


def tail_evidence(champion: Sequence[float], candidate: Sequence[float], q: float, alpha: float,
                  statistic: Literal["quantile", "tail_mean"], *, floor: float = 1.0) -> dict[str, float]:
    """Both directions of the paired tail test at the last record: log e-values against "the candidate is no
    better on the tail" (better) and against "it is no worse" (worse: the same test with the heads swapped), and
    the bar each must reach. Each controls its null at alpha at every look."""
    n = len(champion)
    if not n:
        return {"log_e_better": 0.0, "log_e_worse": 0.0, "log_bar": tail_log_bar(alpha)}
    better = tail_evidence_path(champion, candidate, q, alpha, statistic, floor=floor, looks=[n])[0]
    worse = tail_evidence_path(candidate, champion, q, alpha, statistic, floor=floor, looks=[n])[0]
    return {"log_e_better": float(better), "log_e_worse": float(worse), "log_bar": tail_log_bar(alpha)}


def detectable_tail_gain(champion: Sequence[float], q: float, alpha: float,
                         statistic: Literal["quantile", "tail_mean"], *, floor: float = 1.0,
                         top: float = 1.0) -> float | None:
    """The power of the paired tail test on these champion records: a relative gain g (to `top`, found by
    bisection to 0.005) such that a candidate scoring (1 + g) x the champion on every record reaches the bar at
    the last record and one scoring (1 + g - 0.005) x does not; None when even `top` would not. The e-value is
    not strictly monotone in g, so this is what was checked, not a proof that no smaller gain reaches it.
    Every record gaining alike is the paired test's best case for a given gain."""
    a = np.asarray(champion, dtype=float)
    if not len(a):
        return None
    bar = tail_log_bar(alpha)

    def reaches(g: float) -> bool:
        return tail_evidence_path(a, a * (1.0 + g), q, alpha, statistic, floor=floor, looks=[len(a)])[0] >= bar

    if not reaches(top):
        return None
    lo, hi = 0.0, top  # reaches(hi) and not reaches(lo) (lo = 0: an equal head never reaches it)
    while hi - lo > 0.005:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if reaches(mid) else (mid, hi)
    return round(hi, 2)


__all__ = ["BAND_LEVELS", "BAND_SHARE", "bernoulli_below_log_martingale", "detectable_tail_gain", "first_bounded",
           "quantile_bound", "quantile_bound_path", "quantile_log_evalue_path", "rejecting_count", "tail_evidence",
           "tail_evidence_path", "tail_log_bar", "tail_mean_log_evalue_path", "tail_thresholds"]
