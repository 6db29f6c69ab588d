"""What a draft node is worth and what verifying it costs, measured on the machine at hand.

Owns: the target's verify-forward cost as a function of the number of tokens (calibrated once per
engine, then followed online), the acceptance calibration of draft path probabilities and of
prompt-lookup tokens, and the choice of how much of a draft tree to verify. Must not touch:
models (the engine times its own forwards and passes the numbers in), trees' construction.

Why. How much a bigger tree costs depends on the hardware far more than on the model: on a GPU a
64-token forward costs about what a 1-token one does; on a 2-core AVX2 CPU a 17-token forward
costs ~2.5x (fp16-packed weights) to ~8x (bf16) a 1-token one. A fixed num_draft_tokens is then
either wasteful or timid. Each step keeps the ancestor-closed set of nodes that maximises expected
committed tokens per millisecond, (1 + sum of kept nodes' acceptance) / (draft ms + verify ms).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch


@dataclass
class VerifyCost:
    """Milliseconds of one target forward over q tokens at a context of `ctx` cached tokens.

    points: q -> ms at the reference context `ref` (piecewise linear in q between points), each an exponential
    moving average of the forwards seen at that q, brought to the reference context by the slope.
    slope: q -> ms per cached token (piecewise linear in q likewise): attention reads the whole context for every
    query row, so a 17-token verify that costs 2.7x a 1-token forward at 64 cached tokens costs 3.5x at 2,000
    (SmolLM2, 2-core EPYC). Measured at two contexts when the engine starts (engine.measure_verify_cost); without
    it (pinned costs, a GPU far from saturation) the cost does not depend on the context."""

    points: dict[int, float] = field(default_factory=dict)  # q -> ms at ctx == ref
    decay: float = 0.9
    slope: dict[int, float] = field(default_factory=dict)  # q -> ms per cached token
    ref: int = 0

    def observe(self, q: int, ms: float, ctx: int | None = None) -> None:
        if ctx is not None:
            ms -= self._slope(q) * (ctx - self.ref)
        old = self.points.get(q)
        self.points[q] = ms if old is None else self.decay * old + (1 - self.decay) * ms

    def __call__(self, q: int, ctx: int | None = None) -> float:
        return self.at(ctx)(q)

    def _raw(self, q: int, ctx: int | None) -> float:
        base = _piecewise(self.points, q, float(q))  # no measurement: a cost proportional to size
        if ctx is None or not self.slope:
            return base
        return max(1e-3, base + self._slope(q) * (ctx - self.ref))

    def _slope(self, q: int) -> float:
        return max(0.0, _piecewise(self.slope, q, 0.0, extrapolate=False)) if self.slope else 0.0

    def at(self, ctx: int | None):
        """This cost as a function of q alone, at a context of `ctx` cached tokens (None: the reference one).

        Monotone in q: a forward of q rows is charged no more than one of more rows costs. A timing is a
        minimum plus whatever else ran (a spike only adds time), and a spike in one point's average, or in a
        slope measured at start and multiplied by thousands of cached tokens, would otherwise make a middle
        size dearer than a larger one; the cost model would then avoid that size and never re-time it. So
        each point is capped by the cheapest larger point at this context before interpolating."""
        if not self.points:
            return lambda q: self._raw(q, ctx)
        qs = sorted(self.points)
        env, low = {}, math.inf
        for r in reversed(qs):
            low = min(low, self._raw(r, ctx))
            env[r] = low
        top = qs[-1]
        return lambda q: _piecewise(env, q, float(q)) if q <= top else max(env[top], self._raw(q, ctx))


def _piecewise(points: dict[int, float], q: int, empty: float, extrapolate: bool = True) -> float:
    """points interpolated linearly at q; beyond the last point along the last segment (or proportionally from a
    single point) when `extrapolate`, else the last point's value."""
    if not points:
        return empty
    if q in points:
        return points[q]
    qs = sorted(points)
    if q <= qs[0]:
        return points[qs[0]]
    if q >= qs[-1]:
        if not extrapolate:
            return points[qs[-1]]
        if len(qs) == 1:
            return points[qs[0]] * q / qs[0]
        a, b = qs[-2], qs[-1]
        slope = max(0.0, (points[b] - points[a]) / (b - a))
        return points[b] + slope * (q - b)
    i = bisect.bisect_left(qs, q)
    a, b = qs[i - 1], qs[i]
    w = (q - a) / (b - a)
    return (1 - w) * points[a] + w * points[b]


@dataclass(frozen=True)
class PinnedCosts:
    """Costs a cost-aware engine charges instead of the timings it would measure on the machine: its
    drafting decisions (how much of each tree to verify, whether the head drafts at all) then depend on
    acceptance alone, the same on any machine and under any load. For tests that assert on drafting,
    paired benchmarks and replicas that must draft alike; a serving engine measures by default.

    verify_ms: (tokens, ms) points of one target forward, interpolated like measured ones (VerifyCost).
    overhead_ms: a step's time outside the verify forward (drafting, acceptance, cache upkeep)."""

    verify_ms: tuple[tuple[int, float], ...]
    overhead_ms: float = 0.0

    def __post_init__(self) -> None:
        points = tuple((int(q), float(ms)) for q, ms in self.verify_ms)
        if not points:
            raise ValueError("pinned_costs.verify_ms: give at least one (tokens, ms) point")
        for q, ms in points:
            if q < 1 or not (math.isfinite(ms) and ms > 0):
                raise ValueError(f"pinned_costs.verify_ms: ({q}, {ms}) needs tokens >= 1 and a finite ms > 0")
        if len({q for q, _ in points}) != len(points):
            raise ValueError("pinned_costs.verify_ms: one point per token count")
        if not (math.isfinite(self.overhead_ms) and self.overhead_ms >= 0):
            raise ValueError(f"pinned_costs.overhead_ms: expected a finite value >= 0, got {self.overhead_ms}")
        object.__setattr__(self, "verify_ms", points)

    @classmethod
    def flat(cls, ms: float = 1.0) -> "PinnedCosts":
        """A forward costs the same at any size (as on a GPU far from saturation): every node with any
        chance of acceptance is worth verifying, and the head always drafts."""
        return cls(((1, ms), (1024, ms)), 0.0)

    def verify_cost(self) -> VerifyCost:
        """A cost table holding these points (the engine never feeds it observations)."""
        return VerifyCost(dict(self.verify_ms))


# draft path-probability buckets for acceptance calibration
_EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85, 1.0 + 1e-9)
CALIBRATION_FORMAT = 1


def _bucket(p: float) -> int:
    return min(len(_EDGES) - 2, max(0, bisect.bisect_right(_EDGES, p) - 1))


@dataclass
class BucketCalibration:
    """P(a node is accepted | its proposer's path probability), per probability bucket, from what the
    target accepted so far; starts from the proposer's own probability (a prior worth `prior` nodes)."""

    prior: float = 4.0
    offered: list[float] = field(default_factory=lambda: [0.0] * (len(_EDGES) - 1))
    accepted: list[float] = field(default_factory=lambda: [0.0] * (len(_EDGES) - 1))

    def __call__(self, path_probs: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(path_probs, dtype=torch.float32)
        for i, p in enumerate(path_probs.tolist()):
            b = _bucket(p)
            mid = (_EDGES[b] + min(1.0, _EDGES[b + 1])) / 2
            out[i] = (self.accepted[b] + self.prior * mid) / (self.offered[b] + self.prior)
        return out

    def observe(self, path_probs: list[float], accepted: list[bool]) -> None:
        for p, ok in zip(path_probs, accepted):
            b = _bucket(p)
            self.offered[b] += 1
            self.accepted[b] += ok

    @property
    def observations(self) -> float:
        return sum(self.offered)


@dataclass
class AcceptCalibration:
    """How often drafted nodes are accepted, per proposer, learned from what the target accepted.

    - EAGLE nodes and cross-request suffix nodes: by the proposer's path probability (buckets).
    - Prompt-lookup tokens: P(the lookup token at depth d is accepted | the one before it was), per
      depth: copying comes in runs, so deep tokens of a chain that got that far are likelier than the
      first.
    It belongs to (head version, target, compute mode): it travels with the head (binding.py)."""

    eagle_buckets: BucketCalibration = field(default_factory=BucketCalibration)
    suffix_buckets: BucketCalibration = field(default_factory=BucketCalibration)
    lookup_hits: list[float] = field(default_factory=list)  # per depth (index 0 = depth 1)
    lookup_tries: list[float] = field(default_factory=list)
    lookup_prior: tuple[float, float] = (1.0, 2.0)  # 1 hit in 2 tries

    def eagle(self, path_probs: torch.Tensor) -> torch.Tensor:
        return self.eagle_buckets(path_probs)

    def suffix(self, path_probs: torch.Tensor) -> torch.Tensor:
        return self.suffix_buckets(path_probs)

    def lookup(self, depth: int) -> float:
        """P(the first `depth` lookup tokens are all accepted)."""
        # each depth's rate shrinks towards the rate pooled over all depths (itself starting at the
        # prior): a depth that was rarely offered (e.g. pruned so far) is judged by how runs go
        # elsewhere, not by a fixed guess that would keep it pruned for good
        h0, t0 = self.lookup_prior
        pooled = (sum(self.lookup_hits) + h0) / (sum(self.lookup_tries) + t0)
        p = 1.0
        for j in range(depth):
            hits = self.lookup_hits[j] if j < len(self.lookup_hits) else 0.0
            tries = self.lookup_tries[j] if j < len(self.lookup_tries) else 0.0
            p *= (hits + t0 * pooled) / (tries + t0)
        return p

    def observe_eagle(self, path_probs: list[float], accepted: list[bool]) -> None:
        self.eagle_buckets.observe(path_probs, accepted)

    def observe_suffix(self, path_probs: list[float], accepted: list[bool]) -> None:
        self.suffix_buckets.observe(path_probs, accepted)

    def observe_lookup(self, offered: int, accepted: int) -> None:
        """`accepted` leading lookup tokens were taken out of `offered`: that many successes, plus one
        failure when the run stopped before the chain's end."""
        tried = min(offered, accepted + 1)  # depths the target judged
        while len(self.lookup_tries) < tried:
            self.lookup_tries.append(0.0)
            self.lookup_hits.append(0.0)
        for j in range(tried):
            self.lookup_tries[j] += 1
            self.lookup_hits[j] += j < accepted

    @property
    def observations(self) -> float:
        return self.eagle_buckets.observations + self.suffix_buckets.observations + sum(self.lookup_tries)

    def damped(self, max_offered: float = 50.0, max_lookup_tries: float = 8.0) -> "AcceptCalibration":
        """A copy whose counts weigh at most `max_offered` nodes per probability bucket and
        `max_lookup_tries` lookup runs per depth, rates unchanged: a calibration carried over from
        other traffic (a cache, head.json) starts the engine off right but yields to live evidence
        within a few requests. Lookup acceptance is mostly a property of the traffic (is the request
        copying?), so it is damped harder than the head's own calibration."""
        out = AcceptCalibration()
        for src, dst in ((self.eagle_buckets, out.eagle_buckets), (self.suffix_buckets, out.suffix_buckets)):
            for b, (o, a) in enumerate(zip(src.offered, src.accepted)):
                f = min(1.0, max_offered / o) if o else 1.0
                dst.offered[b], dst.accepted[b] = o * f, a * f
        for t, h in zip(self.lookup_tries, self.lookup_hits):
            f = min(1.0, max_lookup_tries / t) if t else 1.0
            out.lookup_tries.append(t * f)
            out.lookup_hits.append(h * f)
        return out

    # ---- persistence (plain JSON-able dicts; binding.py stores them) ----------------------------
    def to_dict(self) -> dict:
        return {"format": CALIBRATION_FORMAT, "edges": [round(e, 6) for e in _EDGES],
                "eagle": {"offered": self.eagle_buckets.offered, "accepted": self.eagle_buckets.accepted},
                "suffix": {"offered": self.suffix_buckets.offered, "accepted": self.suffix_buckets.accepted},
                "lookup": {"hits": self.lookup_hits, "tries": self.lookup_tries}}

    @classmethod
    def from_dict(cls, raw: dict) -> "AcceptCalibration":
        """Raises ValueError naming the field when `raw` is not a calibration this code wrote."""
        if not isinstance(raw, dict) or raw.get("format") != CALIBRATION_FORMAT:
            raise ValueError(f"calibration.format: expected {CALIBRATION_FORMAT}, got "
                             f"{raw.get('format') if isinstance(raw, dict) else type(raw).__name__}")
        if raw.get("edges") != [round(e, 6) for e in _EDGES]:
            raise ValueError("calibration.edges: written with other probability buckets")

        def counts(path: str, values, length: int | None) -> list[float]:
            if not isinstance(values, list) or (length is not None and len(values) != length) or not all(
                    isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values):
                raise ValueError(f"calibration.{path}: expected {length or 'a list of'} finite counts >= 0")
            return [float(v) for v in values]

        n = len(_EDGES) - 1
        out = cls()
        for name, table in (("eagle", out.eagle_buckets), ("suffix", out.suffix_buckets)):
            part = raw.get(name) or {}
            table.offered = counts(f"{name}.offered", part.get("offered"), n)
            table.accepted = counts(f"{name}.accepted", part.get("accepted"), n)
            if any(a > o for a, o in zip(table.accepted, table.offered)):
                raise ValueError(f"calibration.{name}: more accepted than offered")
        lk = raw.get("lookup") or {}
        out.lookup_hits = counts("lookup.hits", lk.get("hits"), None)
        out.lookup_tries = counts("lookup.tries", lk.get("tries"), len(out.lookup_hits))
        return out


@dataclass
class DraftGate:
    """Whether drafting with the head pays right now, judged by what it delivered: an exponential
    moving average of committed tokens per ms of the steps that drafted with the head, against the
    steps that did not (model-free drafts only, or a plain step). best_prefix sizes a tree once the
    head has drafted; this decides whether to pay for the head at all. Both sides keep being
    measured: while the head loses it still drafts every `probe_every` steps (so the gate notices
    when the text turns predictable); while it wins, every `probe_winner_every` steps go without it
    (so the gate notices when model-free drafts alone do as well, e.g. when a request copies)."""

    decay: float = 0.8
    probe_every: int = 8
    probe_winner_every: int = 16
    draft_rate: float = math.nan  # tokens/ms of steps that drafted with the head
    plain_rate: float = math.nan  # tokens/ms of steps that did not
    skipped: int = 0  # steps in a row without the head (while it loses)
    drafted: int = 0  # steps in a row with the head (while it wins)

    def allow(self, plain_estimate: float) -> bool:
        """plain_estimate: tokens/ms of a step without the head before one was measured."""
        plain = self.plain_rate if math.isfinite(self.plain_rate) else plain_estimate
        if not math.isfinite(self.draft_rate):
            return True
        if self.draft_rate >= plain:
            self.skipped = 0
            self.drafted += 1
            if self.drafted >= self.probe_winner_every:
                self.drafted = 0
                return False
            return True
        self.drafted = 0
        self.skipped += 1
        if self.skipped >= self.probe_every:
            self.skipped = 0
            return True
        return False

    def observe(self, drafted: bool, tokens: int, ms: float) -> None:
        rate = tokens / max(1e-6, ms)
        old = self.draft_rate if drafted else self.plain_rate
        new = rate if not math.isfinite(old) else self.decay * old + (1 - self.decay) * rate
        if drafted:
            self.draft_rate = new
        else:
            self.plain_rate = new


@dataclass
class PlainGate:
    """One request's answer to "does speculating beat plain decoding here?", from its own steps: committed tokens
    per ms of its speculative steps (decayed sums, so about the last 1 / (1 - decay) steps count) against a plain
    step's (its own plain steps' once it has `min_plain` of them, else the caller's estimate). Speculation runs
    until `min_steps` speculative steps were measured (one step's tokens vary from 1 to a whole tree, so fewer
    decide nothing); while it loses, every `probe_every`-th step speculates anyway, so the gate notices when the
    text turns predictable."""

    min_steps: int = 8
    probe_every: int = 4
    decay: float = 0.95
    min_plain: int = 4
    spec_tokens: float = 0.0
    spec_ms: float = 0.0
    spec_steps: int = 0
    plain_tokens: float = 0.0
    plain_ms: float = 0.0
    plain_steps: int = 0
    skipped: int = 0

    def allow(self, plain_estimate: float) -> bool:
        """plain_estimate: tokens/ms of a plain step before `min_plain` were measured."""
        if self.spec_steps < self.min_steps:
            return True
        plain = self.plain_tokens / self.plain_ms if self.plain_steps >= self.min_plain else plain_estimate
        if self.spec_tokens / max(1e-9, self.spec_ms) >= plain:
            self.skipped = 0
            return True
        self.skipped += 1
        if self.skipped >= self.probe_every:
            self.skipped = 0
            return True
        return False

    def observe(self, speculated: bool, tokens: int, ms: float) -> None:
        d = self.decay
        if speculated:
            self.spec_tokens, self.spec_ms = d * self.spec_tokens + tokens, d * self.spec_ms + ms
            self.spec_steps += 1
        else:
            self.plain_tokens, self.plain_ms = d * self.plain_tokens + tokens, d * self.plain_ms + ms
            self.plain_steps += 1


def best_prefix(accept: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, verify_ms, draft_ms: float
                ) -> list[int]:
    """Indices (tree order) of the ancestor-closed node set that maximises
    (1 + sum accept) / (draft_ms + verify_ms(1 + n)).

    accept: [N] estimated acceptance of each node (root → node path). A node is never valued above
    its parent (a child is accepted only with it), so ranking by value keeps ancestors first."""
    n = accept.numel()
    if n == 0:
        return []
    val = accept.float().clone()
    for i in range(n):  # tree order: parents first
        p = int(parents[i])
        if p >= 0:
            val[i] = min(float(val[i]), float(val[p]))
    order = sorted(range(n), key=lambda i: (-float(val[i]), int(depths[i]), i))
    best_k, best_rate, total = 0, 1.0 / max(1e-9, draft_ms + verify_ms(1)), 1.0
    for k, i in enumerate(order, start=1):
        total += float(val[i])
        rate = total / max(1e-9, draft_ms + verify_ms(1 + k))
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return sorted(order[:best_k])


def min_useful_prob(verify_ms, budget: int, rate: float) -> float:
    """The acceptance below which one more node cannot pay for its share of the verify forward at
    the current rate (tokens per ms): expanding frontier paths less likely than this is wasted."""
    marginal = max(0.0, (verify_ms(1 + budget) - verify_ms(1)) / max(1, budget))
    return min(1.0, rate * marginal) if math.isfinite(rate) else 0.0
