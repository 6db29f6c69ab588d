"""Gates: pure functions from per-request samples of two heads to a Decision (promote, reject, continue,
rollback, hold) with a one-sentence reason and the evidence (every number the decision used).

Owns: the statistics of the policy. Must not touch: the registry, the fleet, the log, the clock, any I/O;
the same inputs always give the same Decision (the bootstrap is seeded from the config).

Vocabulary. The *champion* is the head serving now ("none": plain decoding), the *candidate* the head
that wants to replace it. The *tail* is a low quantile of per-request accept length (config.tail_quantile,
0.05: the requests that set P95 time per output token); in the cold start (champion "none") it is a high
quantile of wall seconds per output token (TPOT, config.cold_start_tpot_quantile). The *tail gain* is how
much better the candidate's tail is, in the metric's units (positive = better). Its confidence interval
is a percentile bootstrap (scipy.stats.bootstrap) at two-sided level 2·L − 1, so that its lower bound is
the one-sided bound at the configured level L: a gate promotes only when that bound is > 0, which
allows false promotions at a rate of about 1 − L. Samples of the same records (offline replay, the same
request_id in both) are resampled in pairs, which removes the records' own variance from the difference.

Promote only when (checked in this order; the first failure is the reason): both heads have enough
samples, the tail gain's lower bound is > 0, the mean does not drop by more than config.mean_tolerance,
and no domain with at least config.min_domain_samples requests of each head drops (tail or mean) by more
than config.domain_tolerance (domains are checked when the samples have two or more; untagged requests
form the domain "-"), and, with config.context_guard, no context bucket (the requests' context positions
bucketed at config.context_edges: 0-512 … 8k+) where both heads have config.min_domain_samples requests drops
in mean by more than config.domain_tolerance (requests without a context position are left out of that
slice). The live canary may instead be a non-inferiority check (config.canary_margin > 0): its lower bound
must be above -margin x the champion's tail; the gain itself was shown by the offline gate.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable, Literal, Sequence

import numpy as np
from scipy.stats import bootstrap

from adaptive_eagle.positions import bucket_label, bucket_of
from adaptive_eagle.versions import PLAIN
from policies.config import PolicyConfig
from policies.samples import RequestSample
from policies.sequential import detectable_tail_gain, first_bounded, quantile_bound, tail_evidence

Action = Literal["promote", "reject", "continue", "rollback", "hold"]
PROMOTE, REJECT, CONTINUE, ROLLBACK, HOLD = "promote", "reject", "continue", "rollback", "hold"
ACTIONS = (PROMOTE, REJECT, CONTINUE, ROLLBACK, HOLD)
NO_DOMAIN = "-"  # the domain column of requests without a domain tag


@dataclass(frozen=True)
class Decision:
    """What a gate (or the controller) decided, why in one sentence, and the numbers behind it."""

    action: Action  # promote | reject | continue (need more data) | rollback | hold (keep what serves)
    reason: str  # one sentence an on-call engineer reads
    evidence: dict = field(default_factory=dict)  # JSON-ready: Comparison.as_dict() plus the gate's name

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {self.action!r}")


@dataclass(frozen=True)
class DomainRow:
    """One domain's figures (natural units of the metric)."""

    domain: str
    n_champion: int
    n_candidate: int
    tail_champion: float | None  # None when the head has no request of the domain
    tail_candidate: float | None
    mean_champion: float | None
    mean_candidate: float | None
    checked: bool  # there are >= 2 domains and both heads have config.min_domain_samples requests of this one
    regressed: bool  # checked, and the tail or the mean dropped by more than config.domain_tolerance


@dataclass(frozen=True)
class ContextRow:
    """One context bucket's figures (natural units of the metric): the context-length slice of the guard."""

    bucket: str  # adaptive_eagle.positions label of the requests' context positions, e.g. "2-4k"
    n_champion: int
    n_candidate: int
    mean_champion: float | None  # None when the head has no request in the bucket
    mean_candidate: float | None
    checked: bool  # config.context_guard, and both heads have config.min_domain_samples requests in the bucket
    regressed: bool  # checked, and the mean dropped by more than config.domain_tolerance


@dataclass(frozen=True)
class Comparison:
    """Champion versus candidate on one metric; natural units (TPOT in seconds, accept length in tokens)."""

    metric: str  # "accept_length" (higher is better) or "tpot_s" (lower is better)
    higher_is_better: bool
    quantile: float  # the tail quantile in natural units (0.05 of accept length, 0.95 of TPOT)
    statistic: str  # "quantile" (the tail is that quantile) or "tail_mean" (the mean of the requests beyond it)
    paired: bool  # resampled in pairs of the same request_id
    n_champion: int
    n_candidate: int
    tail_champion: float
    tail_candidate: float
    tail_gain: float  # how much better the candidate's tail is (positive = better), natural units
    ci_low: float  # bounds of tail_gain's interval; ci_low is the one-sided bound at `level`
    ci_high: float
    level: float
    mean_champion: float
    mean_candidate: float
    mean_gain: float  # positive = better
    domains: tuple[DomainRow, ...] = ()
    contexts: tuple[ContextRow, ...] = ()  # by context bucket; only requests with a context position

    def as_dict(self) -> dict:
        d = asdict(self)
        d["domains"] = [asdict(r) for r in self.domains]
        d["contexts"] = [asdict(r) for r in self.contexts]
        return d


# ---- the statistics ---------------------------------------------------------------------------
def tail_of(scores: np.ndarray, q: float, statistic: str = "quantile", axis: int = -1) -> np.ndarray:
    """The lower tail of scores (higher is better) along `axis`: the q-quantile, or the mean of the lowest
    ceil(q·n) scores ("tail_mean", the expected shortfall)."""
    if statistic == "quantile":
        return np.quantile(scores, q, axis=axis)
    if statistic != "tail_mean":
        raise ValueError(f"statistic must be 'quantile' or 'tail_mean', got {statistic!r}")
    n = scores.shape[axis]
    k = max(1, int(np.ceil(q * n - 1e-9)))
    return np.mean(np.moveaxis(np.partition(scores, k - 1, axis=axis), axis, -1)[..., :k], axis=-1)


def _tail(scores: np.ndarray, q: float, statistic: str = "quantile") -> float:
    return float(tail_of(np.asarray(scores, dtype=float), q, statistic))


def tail_gain_interval(champion: np.ndarray, candidate: np.ndarray, *, q: float, level: float, resamples: int,
                       seed: int, paired: bool, statistic: str = "quantile") -> tuple[float, float]:
    """Percentile-bootstrap interval of tail(candidate) − tail(champion) (`tail_of`), two-sided at 2·level − 1
    (so the lower bound is the one-sided bound at `level`). Scores: higher is better. Paired arrays are
    resampled together (index i of both is one record)."""

    def gain(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
        return tail_of(y, q, statistic, axis) - tail_of(x, q, statistic, axis)

    res = bootstrap((champion, candidate), gain, paired=paired, vectorized=True, n_resamples=resamples,
                    confidence_level=2 * level - 1, method="percentile", rng=np.random.default_rng(seed))
    low, high = res.confidence_interval
    return float(low), float(high)


def _dropped(gain: float, champion_value: float, tolerance: float) -> bool:
    """A drop of more than `tolerance` (a fraction of the champion's value); gain is signed, positive = better."""
    return gain < -tolerance * abs(champion_value)


def _domain_rows(champion: Sequence[RequestSample], candidate: Sequence[RequestSample], values, sign: float,
                 q: float, config: PolicyConfig) -> tuple[DomainRow, ...]:
    groups: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for side, samples in enumerate((champion, candidate)):
        for s in samples:
            groups[s.domain or NO_DOMAIN][side].append(values(s))
    rows = []
    for name in sorted(groups):
        a, b = (np.asarray(v, dtype=float) for v in groups[name])
        tail = [_tail(sign * x, q, config.tail_statistic) * sign if len(x) else None for x in (a, b)]
        mean = [float(x.mean()) if len(x) else None for x in (a, b)]
        checked = len(groups) > 1 and len(a) >= config.min_domain_samples and len(b) >= config.min_domain_samples
        regressed = checked and (_dropped(sign * (tail[1] - tail[0]), tail[0], config.domain_tolerance)
                                 or _dropped(sign * (mean[1] - mean[0]), mean[0], config.domain_tolerance))
        rows.append(DomainRow(name, len(a), len(b), tail[0], tail[1], mean[0], mean[1], checked, regressed))
    return tuple(rows)


def _context_rows(champion: Sequence[RequestSample], candidate: Sequence[RequestSample], values, sign: float,
                  config: PolicyConfig) -> tuple[ContextRow, ...]:
    """Both heads' requests by context bucket (config.context_edges), in bucket order; requests without a
    context position are left out."""
    edges = config.context_edges
    groups: dict[int, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for side, samples in enumerate((champion, candidate)):
        for s in samples:
            if s.context is not None:
                groups[bucket_of(s.context, edges)][side].append(values(s))
    rows = []
    for i in sorted(groups):
        a, b = (np.asarray(v, dtype=float) for v in groups[i])
        mean = [float(x.mean()) if len(x) else None for x in (a, b)]
        checked = config.context_guard and min(len(a), len(b)) >= config.min_domain_samples
        regressed = checked and _dropped(sign * (mean[1] - mean[0]), mean[0], config.domain_tolerance)
        label = bucket_label(edges[i], edges[i + 1] if i + 1 < len(edges) else None)
        rows.append(ContextRow(label, len(a), len(b), mean[0], mean[1], checked, regressed))
    return tuple(rows)


def context_guard_reason(rows: Sequence[ContextRow], config: PolicyConfig, fmt: Callable[[float], str] =
                         "{:.3f}".format, what: str = "mean accept length") -> str | None:
    """The guard's reason naming every regressed context bucket, or None when none regressed."""
    bad = [r for r in rows if r.regressed]
    if not bad:
        return None
    names = ", ".join(f"{r.bucket} tokens ({what} {fmt(r.mean_champion)} -> {fmt(r.mean_candidate)}, "
                      f"{r.n_candidate} requests)" for r in bad)
    return f"context length {names} regresses by more than the {config.domain_tolerance:.0%} tolerance"


def compare(champion: Sequence[RequestSample], candidate: Sequence[RequestSample], config: PolicyConfig, *,
            metric: Literal["accept_length", "tpot_s"] = "accept_length", paired: bool = False) -> Comparison:
    """The figures of one comparison. Paired: champion[i] and candidate[i] are the same record. Each side
    needs at least 2 samples (the bootstrap's minimum); the gates check their own, larger minimums first."""
    higher = metric == "accept_length"
    sign = 1.0 if higher else -1.0  # scores: higher is better, so one code path serves both metrics
    q_natural = config.tail_quantile if higher else config.cold_start_tpot_quantile
    q = q_natural if higher else 1.0 - q_natural  # quantile(-x, 1 - p) == -quantile(x, p)

    def values(s: RequestSample) -> float:
        return s.accept_length if higher else float(s.tpot_s)

    a = np.fromiter((values(s) for s in champion), dtype=float, count=len(champion))
    b = np.fromiter((values(s) for s in candidate), dtype=float, count=len(candidate))
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"compare needs >= 2 samples per head, got {len(a)} champion and {len(b)} candidate")
    stat = config.tail_statistic if higher else "quantile"  # the cold start compares P95 TPOT itself
    tail_a, tail_b = sign * _tail(sign * a, q, stat), sign * _tail(sign * b, q, stat)
    low, high = tail_gain_interval(sign * a, sign * b, q=q, level=config.confidence_level,
                                   resamples=config.bootstrap_resamples, seed=config.seed, paired=paired,
                                   statistic=stat)
    mean_a, mean_b = float(a.mean()), float(b.mean())
    return Comparison(metric=metric, higher_is_better=higher, quantile=q_natural, statistic=stat, paired=paired,
                      n_champion=len(a), n_candidate=len(b), tail_champion=tail_a, tail_candidate=tail_b,
                      tail_gain=sign * (tail_b - tail_a), ci_low=low, ci_high=high, level=config.confidence_level,
                      mean_champion=mean_a, mean_candidate=mean_b, mean_gain=sign * (mean_b - mean_a),
                      domains=_domain_rows(champion, candidate, values, sign, q, config),
                      contexts=_context_rows(champion, candidate, values, sign, config))


def pair_by_request(champion: Sequence[RequestSample], candidate: Sequence[RequestSample]
                    ) -> tuple[list[RequestSample], list[RequestSample]] | None:
    """The samples of records both heads scored, in matching order, or None when the samples cannot be
    paired (a missing or repeated request_id on either side, or no record in common)."""
    by_id = [{s.request_id: s for s in side} for side in (champion, candidate)]
    for side, index in zip((champion, candidate), by_id):
        if any(not s.request_id for s in side) or len(index) != len(side):
            return None
    common = sorted(by_id[0].keys() & by_id[1].keys())
    if not common:
        return None
    return [by_id[0][k] for k in common], [by_id[1][k] for k in common]


# ---- the promotion gates ------------------------------------------------------------------------
def _fmt(x: float) -> str:
    return f"{x:+.3f}" if abs(x) >= 1e-3 or x == 0 else f"{x:+.2e}"


def _units(cmp: Comparison) -> tuple[str, Callable[[float], str], Callable[[float], str]]:
    """The tail's name, a value's format and a gain's format: accept length in tokens, TPOT in ms."""
    if cmp.metric == "tpot_s":
        what = f"P{round(100 * cmp.quantile)} TPOT" if cmp.statistic == "quantile" else \
            f"mean TPOT of the slowest {round(100 * (1 - cmp.quantile))}%"
        return what, lambda x: f"{1000 * x:.1f} ms", lambda x: f"{1000 * x:+.1f} ms"
    what = f"p{round(100 * cmp.quantile)} accept length" if cmp.statistic == "quantile" else \
        f"mean accept length of the lowest {round(100 * cmp.quantile)}%"
    return what, lambda x: f"{x:.3f}", _fmt


def _judge(cmp: Comparison, config: PolicyConfig, stage: str, margin: float = 0.0) -> Decision:
    """promote / reject on a comparison whose sample counts are already large enough. `margin` > 0: a
    non-inferiority test (the tail's lower bound above -margin x the champion's tail) instead of a gain."""
    floor = -margin * abs(cmp.tail_champion)
    ev = {"gate": stage, **cmp.as_dict(), **({"margin": margin, "floor": floor} if margin > 0 else {})}
    what, val, gain = _units(cmp)
    mean_what = "mean TPOT" if cmp.metric == "tpot_s" else "mean accept length"
    ci = f"[{gain(cmp.ci_low)}, {gain(cmp.ci_high)}]"
    if not cmp.ci_low > floor:  # floor is 0 without a margin: the tail must improve
        why = f"may be worse by more than the {margin:.0%} margin" if margin > 0 else "does not improve significantly"
        return Decision(REJECT, f"{what} {why}: gain {gain(cmp.tail_gain)}, interval {ci} not above "
                                f"{gain(floor) if margin > 0 else 0} at {cmp.level:.0%}.", ev)
    if _dropped(cmp.mean_gain, cmp.mean_champion, config.mean_tolerance):
        return Decision(REJECT, f"the {mean_what} regresses ({val(cmp.mean_champion)} -> "
                                f"{val(cmp.mean_candidate)}), more than the "
                                f"{config.mean_tolerance:.0%} tolerance.", ev)
    bad = [r for r in cmp.domains if r.regressed]
    if bad:
        names = ", ".join(f"{r.domain} (tail {val(r.tail_champion)} -> {val(r.tail_candidate)}, mean "
                          f"{val(r.mean_champion)} -> {val(r.mean_candidate)})" for r in bad)
        return Decision(REJECT, f"domain {names} regresses by more than the {config.domain_tolerance:.0%} "
                                "tolerance.", ev)
    if guard := context_guard_reason(cmp.contexts, config, val, mean_what):
        return Decision(REJECT, guard + ".", ev)
    if margin > 0:
        return Decision(PROMOTE, f"{what} holds live within the {margin:.0%} margin: gain {gain(cmp.tail_gain)} "
                                 f"({val(cmp.tail_champion)} -> {val(cmp.tail_candidate)}), interval {ci} above "
                                 f"{gain(floor)} at {cmp.level:.0%}.", ev)
    return Decision(PROMOTE, f"{what} improves by {gain(cmp.tail_gain)} ({val(cmp.tail_champion)} -> "
                             f"{val(cmp.tail_candidate)}), interval {ci} above 0 at {cmp.level:.0%}.", ev)


def _too_few(stage: str, n_champion: int, n_candidate: int, needed: int, unit: str) -> Decision | None:
    if n_champion >= needed and n_candidate >= needed:
        return None
    return Decision(CONTINUE, f"need {needed} {unit} per head, have {n_champion} champion and {n_candidate} "
                              "candidate.", {"gate": stage, "n_champion": n_champion, "n_candidate": n_candidate,
                                             "needed": needed})


def offline_gate(champion: Sequence[RequestSample], candidate: Sequence[RequestSample],
                 config: PolicyConfig) -> Decision:
    """Acceptance replay (both heads scored on recent records): promote (to a canary) or reject; continue
    when either side has fewer than config.min_samples. Paired by request_id when both scored the same
    records (only the records in common count), unpaired otherwise."""
    pairs = pair_by_request(champion, candidate)
    a, b = pairs if pairs is not None else (list(champion), list(candidate))
    wait = _too_few("offline", len(a), len(b), config.min_samples, "replayed records")
    if wait is not None:
        return wait
    decision = _judge(compare(a, b, config, paired=pairs is not None), config, "offline")
    return Decision(decision.action, decision.reason,
                    {**decision.evidence, "dropped_unpaired": len(champion) + len(candidate) - len(a) - len(b)})


def pair_in_order(champion: Sequence[RequestSample], candidate: Sequence[RequestSample]
                  ) -> tuple[list[RequestSample], list[RequestSample]]:
    """The records both heads scored, in the champion's (arrival) order. A missing or repeated request id is
    refused: sequential evidence is pairs of the same records."""
    by_id = {s.request_id: s for s in candidate}
    if any(not s.request_id for s in (*champion, *candidate)) or len(by_id) != len(candidate) \
            or len({s.request_id for s in champion}) != len(champion):
        raise ValueError("sequential evidence needs one sample per head and record, each with a request id")
    a = [s for s in champion if s.request_id in by_id]
    return a, [by_id[s.request_id] for s in a]


def sequential_offline_gate(champion: Sequence[RequestSample], candidate: Sequence[RequestSample],
                            config: PolicyConfig, *, final: bool = False) -> Decision:
    """Test-then-train evidence: both heads replayed on records that arrived after the candidate was written
    (it never trained on them), in arrival order, judged every time the evidence grows. The test is of the tail
    statistic itself (config.tail_statistic of per-record accept length at config.tail_quantile), paired and
    anytime-valid in both directions (policies.sequential.tail_evidence):

    - reject as soon as the test against "the candidate is no worse on the tail" is significant;
    - from config.min_samples pairs on, promote (to the canary) once the test against "the candidate is no
      better on the tail" is significant, and the mean and every checked domain and context bucket are within
      their tolerances (otherwise wait for more records);
    - reject as inconclusive when `final` (the trainer closed the evidence) or at config.offline_max_samples.

    The null the promotion controls: the candidate's tail statistic is at most the champion's (an equal head,
    and every worse one, whatever the shape of its change). However often the gate looks, such a head is
    promoted with probability at most 1 - level (tests/policies/test_offline_gate.py checks it by simulation;
    bench/gate_sim.py writes the table in docs/results/)."""
    a_s, b_s = pair_in_order(champion, candidate)
    q, alpha = config.tail_quantile, 1.0 - config.confidence_level
    a = np.array([s.accept_length for s in a_s], dtype=float)
    b = np.array([s.accept_length for s in b_s], dtype=float)
    n = len(a)
    ev: dict = {"gate": "offline_sequential", "n": n, "needed": config.min_samples,
                "max_samples": config.offline_max_samples, "level": config.confidence_level, "quantile": q,
                "statistic": config.tail_statistic, "final": final,
                "dropped_unpaired": len(champion) + len(candidate) - 2 * n}
    if n == 0:
        return Decision(REJECT if final else CONTINUE, "no paired records" + (
            ": the evidence closed empty." if final else " yet."), ev)
    test = tail_evidence(a, b, q, alpha, config.tail_statistic)
    tail_a, tail_b = _tail(a, q, config.tail_statistic), _tail(b, q, config.tail_statistic)
    mean_a, mean_b = float(a.mean()), float(b.mean())
    domains = _domain_rows(a_s, b_s, lambda s: s.accept_length, 1.0, q, config)
    contexts = _context_rows(a_s, b_s, lambda s: s.accept_length, 1.0, config)
    bar = float(np.exp(test["log_bar"]))
    ev.update({"e_better": float(np.exp(min(test["log_e_better"], 700))),
               "e_worse": float(np.exp(min(test["log_e_worse"], 700))), "e_bar": bar,
               "tail_champion": tail_a, "tail_candidate": tail_b, "tail_gain": tail_b - tail_a,
               "mean_champion": mean_a, "mean_candidate": mean_b, "mean_gain": mean_b - mean_a,
               "domains": [asdict(r) for r in domains], "contexts": [asdict(r) for r in contexts]})
    what = (f"p{round(100 * q)} accept length" if config.tail_statistic == "quantile"
            else f"mean accept length of the lowest {round(100 * q)}%")
    record = f"{what} {tail_a:.3f} -> {tail_b:.3f} over {n} paired records"
    if test["log_e_worse"] >= test["log_bar"]:
        return Decision(REJECT, f"worse on the tail: {record}, lower at {config.confidence_level:.0%} at any look "
                                f"(e-value {ev['e_worse']:.1f} >= {bar:.0f}).", ev)
    closing = final or n >= config.offline_max_samples
    why_closed = "the evidence closed" if final else f"{config.offline_max_samples} paired records"
    if n < config.min_samples:
        if final:
            return Decision(REJECT, f"the evidence closed with {n} paired records, fewer than the "
                                    f"{config.min_samples} a promotion needs ({record}). "
                                    f"{_offline_power(a, config, ev)}", ev)
        return Decision(CONTINUE, f"need {config.min_samples} paired records, have {n} ({record}).", ev)
    if test["log_e_better"] < test["log_bar"]:
        if closing:
            return Decision(REJECT, f"inconclusive at {why_closed}: {record}, e-value {ev['e_better']:.2f} under "
                                    f"{bar:.0f}. {_offline_power(a, config, ev)}", ev)
        return Decision(CONTINUE, f"{record}: e-value {ev['e_better']:.2f} of {bar:.0f}, not decided yet.", ev)
    guard = None
    if _dropped(mean_b - mean_a, mean_a, config.mean_tolerance):
        guard = (f"the mean accept length regresses ({mean_a:.3f} -> {mean_b:.3f}), more than the "
                 f"{config.mean_tolerance:.0%} tolerance")
    elif bad := [r for r in domains if r.regressed]:
        guard = "domain " + ", ".join(f"{r.domain} (tail {r.tail_champion:.3f} -> {r.tail_candidate:.3f}, mean "
                                      f"{r.mean_champion:.3f} -> {r.mean_candidate:.3f})" for r in bad) + \
                f" regresses by more than the {config.domain_tolerance:.0%} tolerance"
    else:
        guard = context_guard_reason(contexts, config)
    if guard is not None:
        if closing:
            return Decision(REJECT, f"better on the tail ({record}) but {guard}, at {why_closed}.", ev)
        return Decision(CONTINUE, f"better on the tail ({record}) but {guard}; waiting for more records.", ev)
    # the records the promotion rests on, in the order the test saw them (accept lengths to 6 decimals): the log
    # alone re-runs the test, and the demo bounds its time to promotion from them (demo/phases.py)
    ev["paired_records"] = {"request_id": [s.request_id for s in a_s], "champion": [round(x, 6) for x in a.tolist()],
                            "candidate": [round(x, 6) for x in b.tolist()]}
    return Decision(PROMOTE, f"{what} improves ({tail_a:.3f} -> {tail_b:.3f}, mean {mean_a:.3f} -> {mean_b:.3f}) "
                             f"over {n} paired records: higher at {config.confidence_level:.0%} at any look "
                             f"(e-value {ev['e_better']:.1f} >= {bar:.0f}).", ev)


def _offline_power(champion: np.ndarray, config: PolicyConfig, ev: dict) -> str:
    """What an offline gate that ends without a promotion could have shown on its records (into ev as
    detectable_tail_gain, a share, or None): a gain on every record that reaches the bar on them and one 0.5%
    smaller that does not (policies.sequential.detectable_tail_gain), so the log says what went untested."""
    gain = detectable_tail_gain(champion, config.tail_quantile, 1.0 - config.confidence_level,
                                config.tail_statistic)
    ev["detectable_tail_gain"] = gain
    n = len(champion)
    if gain is None:
        return (f"At {n} paired records it could not have promoted even a head twice as good on every record; "
                "this decision says nothing about the candidate's gain.")
    return (f"At {n} paired records it would have promoted a head {gain:.1%} better on every record, and not one "
            f"{gain - 0.005:.1%} better.")


def canary_gate(champion: Sequence[RequestSample], candidate: Sequence[RequestSample],
                config: PolicyConfig) -> Decision:
    """Live canary that carries the evidence, both heads' requests since the canary began (unpaired). With
    config.sequential, `sequential_canary_gate`; otherwise continue until each head has
    config.canary_min_requests, then promote or reject (one look, so no repeated-testing inflation). With
    config.canary_margin > 0 it is a non-inferiority check: the tail may not be worse beyond the margin."""
    if config.sequential:
        return sequential_canary_gate(champion, candidate, config)
    wait = _too_few("canary", len(champion), len(candidate), config.canary_min_requests, "live requests")
    if wait is not None:
        return wait
    return _judge(compare(champion, candidate, config), config, "canary", margin=config.canary_margin)


def _mean(xs) -> float | None:
    return float(np.mean(xs)) if len(xs) else None


def health_canary_able_at(config: PolicyConfig) -> int:
    """Live requests per head before a health canary can reject anything: its canary_health_requests, at least
    the collapse rule's collapse_min_requests and the count at which its anytime bounds on the medians are
    finite (fewer, and a passing canary would have checked nothing)."""
    return max(config.canary_health_requests, config.collapse_min_requests,
               first_bounded(0.5, (1.0 - config.confidence_level) / 4))


def health_canary_gate(champion: Sequence[RequestSample], candidate: Sequence[RequestSample],
                       config: PolicyConfig) -> Decision:
    """Live canary of a candidate whose gain the offline gate proved on exact (greedy) replay: it checks only
    that the candidate is healthy live, at every tick. Reject at once on a collapse (mean accept length at or
    under config.collapse_accept_length over at least config.collapse_min_requests requests) or as soon as the
    anytime bounds on the medians show harm beyond config.canary_health_margin: the candidate's median accept
    length below the champion's, or its median time per output token above the champion's. Promote when both
    heads served `health_canary_able_at(config)` requests without harm (canary_health_requests, or more when
    the collapse rule or the bounds need more: a canary never passes before it could have failed); continue
    before. The four bounds take (1 - level) / 4 each, so a healthy candidate is rejected with probability at
    most 1 - level however often the gate looks (policies/sequential.py). A pass states the harm it could have
    detected at its size."""
    m, alpha = config.canary_health_margin, (1.0 - config.confidence_level) / 4
    able = health_canary_able_at(config)
    acc = [np.array([s.accept_length for s in side], dtype=float) for side in (champion, candidate)]
    tpot = [np.array([s.tpot_s for s in side if s.tpot_s is not None and np.isfinite(s.tpot_s)], dtype=float)
            for side in (champion, candidate)]

    def median(x: np.ndarray) -> float | None:
        return float(np.median(x)) if len(x) else None

    ev: dict = {"gate": "canary_health", "n_champion": len(champion), "n_candidate": len(candidate),
                "needed": able, "margin": m, "level": config.confidence_level,
                "mean_champion": _mean(acc[0]), "mean_candidate": _mean(acc[1]),
                "median_champion": median(acc[0]), "median_candidate": median(acc[1]),
                "median_tpot_champion": median(tpot[0]), "median_tpot_candidate": median(tpot[1])}
    if len(acc[1]) >= config.collapse_min_requests and ev["mean_candidate"] <= config.collapse_accept_length:
        return Decision(REJECT, f"collapse: the candidate's mean accept length {ev['mean_candidate']:.3f} over "
                                f"{len(acc[1])} live requests is at or under {config.collapse_accept_length:.2f}.", ev)
    bounds = {"accept_upper_candidate": quantile_bound(acc[1], 0.5, alpha, "upper"),
              "accept_lower_champion": quantile_bound(acc[0], 0.5, alpha, "lower"),
              "tpot_lower_candidate": quantile_bound(tpot[1], 0.5, alpha, "lower"),
              "tpot_upper_champion": quantile_bound(tpot[0], 0.5, alpha, "upper")}
    ev.update({k: (v if np.isfinite(v) else None) for k, v in bounds.items()})
    if bounds["accept_upper_candidate"] < (1 - m) * bounds["accept_lower_champion"]:
        return Decision(REJECT, f"live median accept length is lower than the champion's by more than {m:.0%}: "
                                f"{ev['median_champion']:.3f} -> {ev['median_candidate']:.3f} (candidate at most "
                                f"{bounds['accept_upper_candidate']:.3f}, champion at least "
                                f"{bounds['accept_lower_champion']:.3f}, anytime bounds).", ev)
    if bounds["tpot_lower_candidate"] > (1 + m) * bounds["tpot_upper_champion"]:
        return Decision(REJECT, f"live median time per output token is higher than the champion's by more than "
                                f"{m:.0%}: {1000 * ev['median_tpot_champion']:.1f} -> "
                                f"{1000 * ev['median_tpot_candidate']:.1f} ms (anytime bounds).", ev)
    wait = _too_few("canary_health", len(acc[0]), len(acc[1]), able, "live requests")
    if wait is not None:
        why = ("" if able == config.canary_health_requests else
               f" (canary_health_requests is {config.canary_health_requests}, but a health canary cannot fail before "
               f"{able}: the collapse rule needs {config.collapse_min_requests} and the anytime bounds on the "
               f"medians {first_bounded(0.5, alpha)})")
        return Decision(CONTINUE, wait.reason + why, ev)
    power = _health_power(ev, bounds, m)
    ev.update(power)
    tp = ("" if ev["median_tpot_champion"] is None or ev["median_tpot_candidate"] is None else
          f", median TPOT {1000 * ev['median_tpot_champion']:.1f} -> {1000 * ev['median_tpot_candidate']:.1f} ms")
    could = [f"a median accept length {power['detectable_accept_drop']:.0%} or more below the champion's"
             if power["detectable_accept_drop"] is not None else None,
             f"a median TPOT {power['detectable_tpot_rise']:.0%} or more above it"
             if power["detectable_tpot_rise"] is not None else None]
    could_text = " or ".join(c for c in could if c) or "no harm but a collapse (its bounds are still open)"
    return Decision(PROMOTE, f"healthy live over {len(acc[1])} requests: no collapse (mean accept length "
                             f"{ev['mean_candidate']:.3f}), median accept length {ev['median_champion']:.3f} -> "
                             f"{ev['median_candidate']:.3f}{tp}. At this size it could detect {could_text}; a "
                             "smaller harm could not be detected. The gain was proved by the offline gate on exact "
                             "replay.", ev)


def _health_power(ev: dict, bounds: dict, margin: float) -> dict:
    """The harm a health canary could have detected at its size: the rule rejects when the candidate's upper
    bound on its median accept length falls under (1 - margin) x the champion's lower bound, so with the
    bounds' present width it sees a drop of 1 - (1 - margin) (L_champion / median_champion) (median_candidate
    / U_candidate) or more (and the mirror for time per output token); None where a bound is still open."""
    def ratio(x, y):
        return x / y if x is not None and y and np.isfinite(x) and np.isfinite(y) else None

    acc = [ratio(bounds["accept_lower_champion"], ev["median_champion"]),
           ratio(ev["median_candidate"], bounds["accept_upper_candidate"])]
    tp = [ratio(bounds["tpot_upper_champion"], ev["median_tpot_champion"]),
          ratio(ev["median_tpot_candidate"], bounds["tpot_lower_candidate"])]
    return {"detectable_accept_drop": None if None in acc else max(0.0, 1 - (1 - margin) * acc[0] * acc[1]),
            "detectable_tpot_rise": None if None in tp else max(0.0, (1 + margin) * tp[0] * tp[1] - 1)}


def sequential_canary_gate(champion: Sequence[RequestSample], candidate: Sequence[RequestSample],
                           config: PolicyConfig) -> Decision:
    """Live canary that carries the evidence (sampled traffic, where replay is not exact), at every tick from
    config.canary_min_requests on, with anytime-valid bounds on each head's tail quantile (tail_quantile of
    accept length; policies/sequential.py), unpaired. Promote as soon as the candidate's lower bound is above
    (1 - canary_margin) x the champion's upper bound, then the mean and domain checks as the other gates; reject
    as soon as its upper bound is at or under (1 - margin) x the champion's lower bound (it cannot clear the
    bar), or at config.canary_max_requests per head (inconclusive). Each bound takes (1 - level) / 2: a
    candidate under the bar is promoted with probability at most 1 - level however often the gate looks."""
    wait = _too_few("canary", len(champion), len(candidate), config.canary_min_requests, "live requests")
    if wait is not None:
        return wait
    q, m, alpha = config.tail_quantile, config.canary_margin, (1.0 - config.confidence_level) / 2
    a = np.array([s.accept_length for s in champion], dtype=float)
    b = np.array([s.accept_length for s in candidate], dtype=float)
    low_b, high_a = quantile_bound(b, q, alpha, "lower"), quantile_bound(a, q, alpha, "upper")
    high_b, low_a = quantile_bound(b, q, alpha, "upper"), quantile_bound(a, q, alpha, "lower")
    tail_a, tail_b = float(np.quantile(a, q)), float(np.quantile(b, q))
    ev = {"gate": "canary", "sequential": True, "quantile": q, "margin": m, "level": config.confidence_level,
          "n_champion": len(a), "n_candidate": len(b), "tail_champion": tail_a, "tail_candidate": tail_b,
          "mean_champion": float(a.mean()), "mean_candidate": float(b.mean()),
          **{k: (float(v) if np.isfinite(v) else None) for k, v in (
              ("tail_lower_candidate", low_b), ("tail_upper_champion", high_a), ("tail_upper_candidate", high_b),
              ("tail_lower_champion", low_a))},
          "domains": [asdict(r) for r in _domain_rows(champion, candidate, lambda s: s.accept_length, 1.0, q,
                                                      config)]}
    contexts = _context_rows(champion, candidate, lambda s: s.accept_length, 1.0, config)
    ev["contexts"] = [asdict(r) for r in contexts]
    what = f"p{round(100 * q)} accept length"
    bar = f"{1 - m:.0%} of the champion's" if m > 0 else "the champion's"
    if low_b > (1 - m) * high_a:
        if _dropped(ev["mean_candidate"] - ev["mean_champion"], ev["mean_champion"], config.mean_tolerance):
            return Decision(REJECT, f"the mean accept length regresses ({ev['mean_champion']:.3f} -> "
                                    f"{ev['mean_candidate']:.3f}), more than the {config.mean_tolerance:.0%} "
                                    "tolerance.", ev)
        bad = [r for r in ev["domains"] if r["regressed"]]
        if bad:
            return Decision(REJECT, f"domain {', '.join(r['domain'] for r in bad)} regresses by more than the "
                                    f"{config.domain_tolerance:.0%} tolerance.", ev)
        if guard := context_guard_reason(contexts, config):
            return Decision(REJECT, guard + ".", ev)
        return Decision(PROMOTE, f"{what} is above {bar} at every look's level {config.confidence_level:.0%}: "
                                 f"{tail_a:.3f} -> {tail_b:.3f} (candidate at least {low_b:.3f}, champion at most "
                                 f"{high_a:.3f}) after {len(b)} live requests.", ev)
    if high_b <= (1 - m) * low_a:
        return Decision(REJECT, f"{what} cannot clear {bar}: {tail_a:.3f} -> {tail_b:.3f} (candidate at most "
                                f"{high_b:.3f}, champion at least {low_a:.3f}) after {len(b)} live requests.", ev)
    if min(len(a), len(b)) >= config.canary_max_requests:
        return Decision(REJECT, f"inconclusive after {config.canary_max_requests} live requests per head: {what} "
                                f"{tail_a:.3f} -> {tail_b:.3f}, the bounds still overlap the bar.", ev)
    return Decision(CONTINUE, f"{what} {tail_a:.3f} -> {tail_b:.3f} after {len(b)} live requests: not decided "
                              "yet (anytime bounds).", ev)


def cold_start_gate(plain: Sequence[RequestSample], candidate: Sequence[RequestSample],
                    config: PolicyConfig) -> Decision:
    """Champion "none": the head replaces plain decoding only when its wall time per output token beats
    plain decoding's at the tail (config.cold_start_tpot_quantile, P95), with the interval above 0; live
    samples without a finite tpot_s are ignored. Continue until each side has config.canary_min_requests."""
    timed = [[s for s in side if s.tpot_s is not None and np.isfinite(s.tpot_s)] for side in (plain, candidate)]
    wait = _too_few("cold_start", len(timed[0]), len(timed[1]), config.canary_min_requests, "timed requests")
    if wait is not None:
        return wait
    return _judge(compare(timed[0], timed[1], config, metric="tpot_s"), config, "cold_start")


# ---- after a promotion ------------------------------------------------------------------------
def rollback_check(previous_baseline: Sequence[RequestSample], live_after_promotion: Sequence[RequestSample],
                   config: PolicyConfig) -> Decision:
    """Watch a new champion: rollback on a collapse (mean accept length <= config.collapse_accept_length
    over its last >= config.collapse_min_requests requests, checked at once) or when, after
    config.rollback_window requests, its tail is below the previous champion's baseline by more than
    config.rollback_margin with the whole interval below; hold when the window passes; continue before.
    A plain-decoding baseline ("none") is compared on TPOT, when both sides are timed; a baseline of fewer than
    config.collapse_min_requests requests is not compared (only the collapse check applies)."""
    live = sorted(live_after_promotion, key=lambda s: s.finished_at)[-config.rollback_window:]
    n = len(live)
    ev: dict = {"gate": "rollback", "n_live": n, "window": config.rollback_window}
    if n < config.collapse_min_requests:
        return Decision(CONTINUE, f"watching: {n} of {config.collapse_min_requests} requests before a collapse "
                                  "can be judged.", ev)
    mean = float(np.mean([s.accept_length for s in live]))
    ev["mean_accept_length"] = mean
    if mean <= config.collapse_accept_length:
        return Decision(ROLLBACK, f"collapse: mean accept length {mean:.3f} over the last {n} requests is at or "
                                  f"under {config.collapse_accept_length:.2f}.", ev)
    if n < config.rollback_window:
        return Decision(CONTINUE, f"watching: {n} of {config.rollback_window} requests, mean accept length "
                                  f"{mean:.3f}.", ev)
    cmp = _baseline_comparison(previous_baseline, live, config)
    if cmp is None:
        return Decision(HOLD, f"watch passed: no collapse over {n} requests (mean accept length {mean:.3f}); "
                              "no baseline to compare the tail with.", ev)
    ev.update(cmp.as_dict())
    what, val, gain = _units(cmp)
    tpot = _tpot_note(previous_baseline, live, ev) if cmp.metric != "tpot_s" else ""
    if cmp.ci_high < -config.rollback_margin * abs(cmp.tail_champion):
        return Decision(ROLLBACK, f"{what} fell from {val(cmp.tail_champion)} to {val(cmp.tail_candidate)}, "
                                  f"interval [{gain(cmp.ci_low)}, {gain(cmp.ci_high)}] wholly below the "
                                  f"{config.rollback_margin:.0%} margin{tpot}.", ev)
    # what this window could see: a fall past the margin by more than half the interval's width puts the whole
    # interval below the margin (a fall nearer the margin could pass unseen)
    detectable = config.rollback_margin * abs(cmp.tail_champion) + (cmp.ci_high - cmp.ci_low) / 2
    ev["detectable_fall"] = detectable
    return Decision(HOLD, f"watch passed: {what} {val(cmp.tail_champion)} -> {val(cmp.tail_candidate)} over {n} "
                          f"requests, interval [{gain(cmp.ci_low)}, {gain(cmp.ci_high)}] not wholly below the "
                          f"{config.rollback_margin:.0%} margin{tpot}. At this size it could detect a fall of about "
                          f"{val(detectable) if cmp.metric != 'tpot_s' else gain(detectable)} or more "
                          f"({detectable / abs(cmp.tail_champion):.0%}); a smaller one could pass unseen.", ev)


def _tpot_note(before: Sequence[RequestSample], after: Sequence[RequestSample], ev: dict) -> str:
    """The time-per-token effect next to the accept-length one: median TPOT of the previous champion's live
    requests and of the new champion's ("" when either side has fewer than 2 timed). A description, not a test:
    the two sides ran one after the other, under whatever load each met (the holdback arm measures it at the
    same time: ae_loop_tpot_gain)."""
    med = [float(np.median(v)) if len(v := [s.tpot_s for s in side if s.tpot_s is not None and np.isfinite(s.tpot_s)])
           >= 2 else None for side in (before, after)]
    if None in med:
        return ""
    ev["median_tpot_before"], ev["median_tpot_after"] = med
    return (f"; median TPOT {1000 * med[0]:.1f} -> {1000 * med[1]:.1f} ms (before vs after: not a test, the load "
            "differs)")


def _baseline_comparison(baseline: Sequence[RequestSample], live: Sequence[RequestSample],
                         config: PolicyConfig) -> Comparison | None:
    """None when there is no baseline worth comparing a tail with (fewer than collapse_min_requests requests)."""
    if len(baseline) < config.collapse_min_requests:
        return None
    plain = bool(baseline) and all(s.head_version == PLAIN for s in baseline)
    if plain:  # accept length 1.0 everywhere: only wall time can say whether the head pays
        timed = [[s for s in side if s.tpot_s is not None and np.isfinite(s.tpot_s)] for side in (baseline, live)]
        return compare(*timed, config, metric="tpot_s") if min(map(len, timed)) >= 2 else None
    return compare(baseline, live, config) if len(baseline) >= 2 else None


def domains_line(domains: Sequence[dict]) -> str:
    """Which domains a head moves up and which down, for a promotion's log line: each domain's mean accept length,
    champion -> candidate, on the evidence the decision read (point estimates, with each domain's records per
    head), and whether the per-domain guard checked it ("unchecked": fewer than min_domain_samples records, or
    one domain only). '' when the evidence has no domain rows."""
    up, down = [], []
    for d in domains:
        a, b = d.get("mean_champion"), d.get("mean_candidate")
        if a is None or b is None or not a:
            continue
        n = min(d.get("n_champion", 0), d.get("n_candidate", 0))
        text = f"{d['domain']} {a:.3f}->{b:.3f} ({100 * (b / a - 1):+.1f}%, {n} records" + \
            ("" if d.get("checked") else ", unchecked") + ")"
        (up if b >= a else down).append((b / a, text))
    if not up and not down:
        return ""
    parts = []
    if up:
        parts.append("helps " + ", ".join(t for _, t in sorted(up, reverse=True)))
    if down:
        parts.append("hurts " + ", ".join(t for _, t in sorted(down)))
    return "by domain, mean accept length on its evidence (point estimates): " + "; ".join(parts)


__all__ = [
    "ACTIONS", "CONTINUE", "HOLD", "PROMOTE", "REJECT", "ROLLBACK", "Action", "Comparison", "ContextRow", "Decision",
    "DomainRow", "context_guard_reason", "domains_line", "health_canary_able_at",
    "canary_gate", "cold_start_gate", "compare", "health_canary_gate", "offline_gate", "pair_by_request",
    "pair_in_order", "rollback_check", "sequential_canary_gate", "sequential_offline_gate",
    "tail_gain_interval", "tail_of",
]
