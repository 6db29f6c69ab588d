"""Per-phase figures of a run through several drifts: what the served heads gained over the frozen shipped head
in each phase, how fast a promotion answered each drift, and what a returning domain forgot.

Owns: the phase figures (`phase_figures`) and their intervals. Must not touch: the stack, decoding, the report's
files (report.py writes what this returns into summary.json and report.md).

Every figure compares heads on the SAME requests: a request's served accept length comes from its captured
trace, the frozen head's from acceptance replay of that record (control.StepCounts; exact for greedy traffic).
Accept length is tokens per verify step over every step of the requests but each one's last. Intervals are 90%
percentile-bootstrap intervals over requests (paired: one resample of requests scores both heads).

Per phase:
- `drifted`: the phase's domain differs from the previous phase's (every phase but the first: a scenario never
  repeats a domain twice in a row); `returning`: the domain was served in an earlier phase.
- `gain_pct`: served over frozen accept length on the phase's requests, in percent.
- `tpot_gain`: time per output token, the holdback arm's median over the served arm's (the frozen head decoding
  its share of the same traffic on the same replicas at the same time); above 1 the served heads were faster.
- `time_to_promotion_s`: from the phase's start to the first promotion within it of a head that then served the
  phase's requests better than the frozen head did on the same requests; `time_to_any_promotion_s`: to the first
  promotion of any head. None when none came in the phase. Its interval (`time_to_promotion_s_interval`) is over
  requests too: the paired records the sequential gate promoted on (the promotion log keeps them) are resampled
  locally in arrival order (each position draws one of the records within a twentieth of the evidence either side
  of it; past the last record, from the latest tenth), the gate's tail test is re-run on each resample, and its
  first passing look is put on the clock (the records' own finish times, the evidence's arrival rate past the last
  one, and this promotion's lag from its last record to the swap). Local, because evidence under drift is not
  stationary: which domains came when shapes the test's path (a plain resample that mixes the whole evidence
  put a run's own time to promotion below its interval). So it says how soon the same traffic, other requests of
  it, could have decided; it holds the candidate, the host's speed and the canary fixed (runs vary in those:
  compare runs for that), and the mean and per-domain guards are not re-run. Its upper end is None when more
  than 5% of resamples reach no decision within 3x the records seen (or the gate's maximum).
- `forgetting_pct` (returning phases): how much of its best gain on this domain the run lost by the time the
  domain came back. The gain is served over frozen accept length on the same requests, so the prompts'
  difficulty cancels: best = the highest such ratio over the last third of each earlier phase of the domain
  (after it adapted), now = the ratio over the first third of this phase (before it adapts again);
  forgetting_pct = 100 * (1 - now / best), positive when the run forgot. Its interval resamples both windows.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from adaptive_eagle_cli.demo.config import Phase
from adaptive_eagle_cli.demo.report import _tpot_ms, _trimmed, beats_frozen, tpot_gain_interval
from policies.sequential import tail_evidence_path, tail_log_bar

LEVEL = 0.9
RESAMPLES = 2000
MIN_REQUESTS = 5  # fewer scored requests in a window: no figure
DECISION_RESAMPLES = 200  # each re-runs the tail test on every look of up to 3x the records (~0.1-0.3 s each)


def _sums(steps: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per request: accepted drafts and verify steps over every step but its last."""
    acc = np.array([sum(a[:-1]) for a in steps], dtype=float)
    n = np.array([max(len(a) - 1, 0) for a in steps], dtype=float)
    return acc, n


def _ratio(served: Sequence[Sequence[int]], frozen: Sequence[Sequence[int]]) -> Optional[float]:
    """Served accept length over frozen accept length on the same requests (None when either has no step)."""
    (a, n), (b, m) = _sums(served), _sums(frozen)
    if n.sum() == 0 or m.sum() == 0:
        return None
    return float((1 + a.sum() / n.sum()) / (1 + b.sum() / m.sum()))


def _boot_ratios(served, frozen, rng) -> np.ndarray:
    """Bootstrap distribution of `_ratio` (requests resampled, the same ones for both heads)."""
    (a, n), (b, m) = _sums(served), _sums(frozen)
    idx = rng.integers(0, len(a), (RESAMPLES, len(a)))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (1 + a[idx].sum(1) / n[idx].sum(1)) / (1 + b[idx].sum(1) / m[idx].sum(1))


def _interval(xs: np.ndarray, scale=lambda x: x) -> Optional[tuple[float, float]]:
    xs = xs[np.isfinite(xs)]
    if not len(xs):
        return None
    lo, hi = np.quantile(xs, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return round(float(scale(lo)), 2), round(float(scale(hi)), 2)


def decision_time_interval(gate: dict, finished_s: dict, promoted_s: float, rng) -> Optional[tuple]:
    """90% interval of the time (seconds after traffic began) at which the same candidate would have been promoted
    on another draw of its evidence (module docstring); None when the gate's evidence has no paired records or
    the requests of fewer than half of them are known. gate: the offline_sequential evidence of its canary_started event;
    finished_s: request_id -> when its request finished."""
    rec = gate.get("paired_records") or {}
    ids = rec.get("request_id") or []
    known = np.array([i in finished_s for i in ids], dtype=bool)
    if known.sum() < max(2, len(ids) / 2):  # most records' requests unknown: not this run's gate
        return None
    a, b = np.asarray(rec["champion"], dtype=float), np.asarray(rec["candidate"], dtype=float)
    # a record whose client gave up (captured, but no response seen) takes its time from its neighbours
    t = np.interp(np.arange(len(ids)), np.flatnonzero(known), [finished_s[i] for i in ids if i in finished_s])
    n, needed, q = len(ids), int(gate["needed"]), float(gate["quantile"])
    alpha, stat = 1.0 - float(gate["level"]), gate["statistic"]
    horizon = min(int(gate.get("max_samples") or 3 * n), 3 * n)
    rate = (n - 1) / (t[-1] - t[0]) if n > 1 and t[-1] > t[0] else None  # records per second over the evidence
    lag = promoted_s - t[-1]  # from its last record to the swap: the gate's look and the canary
    bar, looks = tail_log_bar(alpha), np.arange(1, horizon + 1)
    times = []
    half = max(2, n // 20)
    centre = np.minimum(np.arange(horizon), n - 1 - half)  # past the evidence: its latest tenth
    for _ in range(DECISION_RESAMPLES):
        idx = np.clip(centre + rng.integers(-half, half + 1, horizon), 0, n - 1)
        better = tail_evidence_path(a[idx], b[idx], q, alpha, stat, looks=looks)
        worse = tail_evidence_path(b[idx], a[idx], q, alpha, stat, looks=looks)
        passed = np.flatnonzero((better >= bar) & (looks >= needed))
        rejected = np.flatnonzero(worse >= bar)
        k = int(passed[0]) + 1 if len(passed) and not (len(rejected) and rejected[0] < passed[0]) else None
        if k is None or (k > n and rate is None):
            times.append(np.inf)
        else:
            times.append((t[k - 1] if k <= n else t[-1] + (k - n) / rate) + lag)
    lo, hi = np.quantile(np.array(times), [(1 - LEVEL) / 2, (1 + LEVEL) / 2], method="inverted_cdf")
    return (None if not np.isfinite(lo) else float(lo)), (None if not np.isfinite(hi) else float(hi))


def phase_figures(results: Sequence, phases: Sequence[Phase], counts: dict, promotions: Sequence[tuple[float, str]],
                  seed: int = 0, gates: Optional[dict] = None) -> list[dict]:
    """One dict a phase (the module docstring says what each figure is). results: the run's RequestResults;
    counts: request_id -> control.StepCounts; promotions: (seconds after traffic began, version promoted);
    gates: version -> the evidence its offline gate promoted it on (its canary_started event's), for the
    interval of the time to promotion."""
    rng = np.random.default_rng(seed)
    finished_s = {r.request_id: r.finished_s for r in results if r.request_id}
    scored = {i: [r for r in results if r.ok and r.phase == i and r.request_id in counts] for i in range(len(phases))}
    out = []
    for i, p in enumerate(phases):
        rs = scored[i]
        served, frozen = [counts[r.request_id].served for r in rs], [counts[r.request_id].frozen for r in rs]
        gain = _ratio(served, frozen) if len(rs) >= MIN_REQUESTS else None
        ok = [r for r in results if r.ok and r.phase == i]
        tpot_s, tpot_h = _tpot_ms(ok, "served"), _tpot_ms(ok, "holdback")
        mine = sorted((t, v) for t, v in promotions if p.start_s <= t < p.end_s)

        def helped(version: str) -> bool:
            return beats_frozen([counts[r.request_id] for r in rs if r.head_version == version]) is True

        helping = [(t, v) for t, v in mine if helped(v)]
        earlier = [j for j in range(i) if phases[j].domain == p.domain]
        fig = {"phase": i, "domain": p.domain, "start_s": round(p.start_s, 1), "end_s": round(p.end_s, 1),
               "drifted": i > 0 and p.domain != phases[i - 1].domain, "returning": bool(earlier),
               "requests": len(rs), "accept_length_served": _trimmed(served),
               "accept_length_frozen": _trimmed(frozen),
               "gain_pct": None if gain is None else round(100 * (gain - 1), 2),
               "gain_pct_interval": _interval(_boot_ratios(served, frozen, rng), lambda x: 100 * (x - 1))
               if gain is not None else None,
               "tpot_ms_served": tpot_s, "tpot_ms_frozen": tpot_h,
               "tpot_gain": round(tpot_h / tpot_s, 3) if tpot_s and tpot_h else None,
               "tpot_gain_interval": tpot_gain_interval(ok),
               "promotions": len(mine),
               "time_to_promotion_s": round(helping[0][0] - p.start_s, 1) if helping else None,
               "time_to_promotion_s_interval": _shifted(decision_time_interval(
                   (gates or {}).get(helping[0][1]) or {}, finished_s, helping[0][0], rng), -p.start_s)
               if helping else None,
               "time_to_any_promotion_s": round(mine[0][0] - p.start_s, 1) if mine else None,
               "forgetting_pct": None, "forgetting_pct_interval": None}
        if earlier:
            fig.update(_forgetting(p, [phases[j] for j in earlier], [scored[j] for j in earlier], rs, counts, rng))
        out.append(fig)
    return out


def _shifted(iv: Optional[tuple], by: float) -> Optional[tuple]:
    return None if iv is None else tuple(None if x is None else round(x + by, 1) for x in iv)


def _forgetting(now_phase: Phase, before: Sequence[Phase], before_rs: Sequence[Sequence], rs: Sequence, counts: dict,
                rng) -> dict:
    third = (now_phase.end_s - now_phase.start_s) / 3
    now = [r for r in rs if r.started_s < now_phase.start_s + third]
    best = None
    for p, prs in zip(before, before_rs):
        tail = [r for r in prs if r.started_s >= p.end_s - (p.end_s - p.start_s) / 3]
        if len(tail) < MIN_REQUESTS:
            continue
        ratio = _ratio([counts[r.request_id].served for r in tail], [counts[r.request_id].frozen for r in tail])
        if ratio is not None and (best is None or ratio > best[0]):
            best = (ratio, tail)
    if best is None or len(now) < MIN_REQUESTS:
        return {}
    now_s, now_f = [counts[r.request_id].served for r in now], [counts[r.request_id].frozen for r in now]
    ratio_now = _ratio(now_s, now_f)
    if ratio_now is None:
        return {}
    best_s, best_f = [counts[r.request_id].served for r in best[1]], [counts[r.request_id].frozen for r in best[1]]
    boot = 100 * (1 - _boot_ratios(now_s, now_f, rng) / _boot_ratios(best_s, best_f, rng))
    return {"forgetting_pct": round(100 * (1 - ratio_now / best[0]), 2), "forgetting_pct_interval": _interval(boot),
            "forgetting_requests": [len(now), len(best[1])]}


__all__ = ["phase_figures"]
