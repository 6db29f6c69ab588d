"""Prometheus metrics of one gateway, in its own CollectorRegistry (never the global default one,
so two apps in one process, as in tests, never collide).

Owns: metric names, labels and buckets; `observe` for a finished request, `refresh` from replica
statuses at scrape time (a replica that did not answer is `ae_replica_up` 0; the gateway counts replica
failures in `ae_replica_failures_total` as they happen). Must not touch: routing, decoding.

A backend's own counts (`ServerStatus.info`, the backend's `info()`: SGLang's `counts` and `down`) are exported
as they stand in each replica's last answer (BackendCollector): swaps by how they were done, requests the
backend lost by reason, and whether the backend is down (its reason stays in the status, /admin/status,
never in a label). They are the replica's own cumulative counts, so a restarted replica starts them at 0 again,
which `increase()` and `rate()` read as a counter reset.

Per-request acceptance is a histogram by head version and domain, so tail acceptance (the policy's
gate) can be read from /metrics, unlike SGLang's batch-level gauges. Acceptance by context length is two
counters by head version and context bucket (adaptive_eagle.positions.DEFAULT_EDGES: six labels, 0-512 …
8k+), `ae_verify_steps` and `ae_accepted_drafts`: each verify step counts in the bucket of the position its
first draft predicts, so a bucket's accept length is 1 + accepted drafts / verify steps (rate them alike).
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from adaptive_eagle.positions import DEFAULT_EDGES, bucket_labels, context_position, label_of, step_positions
from adaptive_eagle.trace import TraceRecord
from policies.holdback import HoldbackWindow
from serving.messages import ServerStatus, SpecMetrics

log = logging.getLogger(__name__)

ACCEPT_BUCKETS = (1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
RATE_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 250, 500, 1000)
CONTEXT_LABELS = bucket_labels(DEFAULT_EDGES)  # the only values of the `context` label
CONTEXT_HELP = ("context bucket of the position each verify step's first draft predicts (prompt tokens + 1 + "
                "the tokens committed before the step; buckets " + ", ".join(CONTEXT_LABELS) + "; on the SGLang "
                "backend, which does not report the order of a request's steps, the positions within a request are "
                "approximate)")


def context_fields(trace: TraceRecord) -> dict:
    """SpecMetrics' context fields of one finished request: its context position and, per context bucket its
    verify steps started in, (label, steps, accepted drafts). Empty without a prompt (nothing to place)."""
    prompt = next((i for i, m in enumerate(trace.loss_mask) if m), len(trace.loss_mask))
    if prompt < 1:
        return {}
    accepted = [s.accept_length for s in trace.steps]
    tally: dict[str, list[int]] = {}
    for pos, a in zip(step_positions(prompt, accepted), accepted):
        t = tally.setdefault(label_of(pos), [0, 0])
        t[0], t[1] = t[0] + 1, t[1] + a
    return {"context_position": context_position(prompt, len(trace.loss_mask) - prompt),
            "by_context": tuple((k, *tally[k]) for k in CONTEXT_LABELS if k in tally)}


# serving/sglang_backend.py SGLangBackend.counts: how a swap was done (in place through a weight-update session,
# by restarting SGLang on the head: a cold start, or refused with the old head kept) and why a request was lost
SWAP_COUNTS = {"session_swaps": "session", "restart_swaps": "restart", "refused_swaps": "refused"}
LOST_COUNTS = ("aborted", "refused_by_sglang", "broken_streams", "protocol_errors")  # _failure_kind's values


class LoopGainCollector:
    """ae_loop_tpot_gain / ae_loop_accept_gain{domain, stat}: per domain, the holdback arm's figures against the
    served arm's over the newest requests (policies.holdback.HoldbackWindow; stat: point, p05, p95 of a 90%
    bootstrap interval), computed at scrape time; a domain shows once both arms have MIN_PER_ARM requests.
    ae_loop_domain_accept_length{domain, arm}: each arm's median accept length (served: the champion and any
    canary; holdback: the frozen baseline). ae_loop_forgetting_pct{domain, stat}: how far the domain's newest
    block of served requests fell below the best block the run served on it, each relative to the frozen arm
    (policies.holdback.Forgetting), once two blocks closed."""

    def __init__(self, window: HoldbackWindow) -> None:
        self.window = window

    def describe(self):
        return list(self._families([])) + list(self._by_domain([], []))

    def collect(self):
        domains = self.window.domains()
        gains = [g for d in domains if (g := self.window.gain(d, resamples=200)) is not None]
        forgetting = [f for d in domains if (f := self.window.forgetting(d, resamples=200)) is not None]
        return list(self._families(gains)) + list(self._by_domain([(d, self.window.medians(d)) for d in domains],
                                                                  forgetting))

    @staticmethod
    def _by_domain(medians, forgetting):
        accept = GaugeMetricFamily("ae_loop_domain_accept_length", "Median accept length per domain and arm over "
                                   "the newest requests (served: the champion and any canary; holdback: the frozen "
                                   "baseline head, same replicas and time)", labels=["domain", "arm"])
        for domain, by_arm in medians:
            for arm, v in by_arm.items():
                accept.add_metric([domain, arm], v)
        forgot = GaugeMetricFamily("ae_loop_forgetting_pct", "Percent of the best block gain over the frozen arm "
                                   "that the newest block of the domain's served requests lost (positive: "
                                   "forgotten; stat point, p05, p95 of a 90% interval)", labels=["domain", "stat"])
        for f in forgetting:
            for stat, v in (("point", f.pct), ("p05", f.pct_90[0]), ("p95", f.pct_90[1])):
                forgot.add_metric([f.domain, stat], v)
        return [accept, forgot]

    @staticmethod
    def _families(gains):
        tpot = GaugeMetricFamily("ae_loop_tpot_gain", "Frozen baseline's median time per output token over the "
                                 "served heads', same replicas and time (holdback arm); above 1: adapting pays",
                                 labels=["domain", "stat"])
        accept = GaugeMetricFamily("ae_loop_accept_gain", "Served heads' median accept length over the frozen "
                                   "baseline's (holdback arm)", labels=["domain", "stat"])
        for g in gains:
            for fam, point, (lo, hi) in ((tpot, g.tpot_gain, g.tpot_gain_90), (accept, g.accept_gain,
                                                                                 g.accept_gain_90)):
                for stat, v in (("point", point), ("p05", lo), ("p95", hi)):
                    fam.add_metric([g.domain, stat], v)
        return [tpot, accept]


class BackendCollector:
    """ae_backend_*: each replica's backend counts and down state from its last status. A count this collector
    does not know by name is still exported, under ae_backend_events_total (never dropped unseen)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[dict, Optional[str], bool]] = {}  # replica -> (counts, down, reports down)

    def update(self, statuses: Iterable[ServerStatus]) -> None:
        last = dict(self._last)
        for s in statuses:
            info = s.info or {}
            if "counts" not in info and "down" not in info:
                continue  # a backend without counts of its own
            down = info.get("down") or None
            if down and not (last.get(s.replica) or ({}, None, False))[1]:
                log.error("replica %s: its %s backend is down: %s", s.replica, info.get("backend", "?"), down)
            last[s.replica] = ({str(k): v for k, v in (info.get("counts") or {}).items()}, down, "down" in info)
        self._last = last  # replaced whole: a scrape reads one consistent snapshot

    def describe(self):
        return list(self._families({}))

    def collect(self):
        return list(self._families(self._last))

    @staticmethod
    def _families(last: Mapping[str, tuple[dict, Optional[str], bool]]):
        swaps = CounterMetricFamily("ae_backend_swaps", "Head swaps the replica's backend did, by how: session (in "
                                    "place, a draft-only weight update), restart (SGLang restarted on the head: a cold "
                                    "start), refused (the old head kept serving)", labels=["replica", "how"])
        lost = CounterMetricFamily("ae_backend_requests_lost", "Requests the backend did not finish, by reason "
                                   "(aborted, refused_by_sglang, broken_streams, protocol_errors)",
                                   labels=["replica", "reason"])
        events = CounterMetricFamily("ae_backend_events", "Other counts the backend reports (e.g. straddled_requests: "
                                     "requests that straddled a weight update)",
                                     labels=["replica", "event"])
        down = GaugeMetricFamily("ae_backend_down", "1 while the replica's backend says it cannot serve (SGLang: a "
                                 "restart that failed, an update that could not be undone); the reason is in "
                                 "/admin/status, replicas[].info.down", labels=["replica"])
        for replica, (counts, why, reports_down) in sorted(last.items()):
            for key, n in sorted(counts.items()):
                if key in SWAP_COUNTS:
                    swaps.add_metric([replica, SWAP_COUNTS[key]], float(n))
                elif key in LOST_COUNTS:
                    lost.add_metric([replica, key], float(n))
                else:
                    events.add_metric([replica, key], float(n))
            if reports_down:
                down.add_metric([replica], 1.0 if why else 0.0)
        return swaps, lost, events, down


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.accept_length = Histogram("ae_accept_length", "Per-request accept length (tokens per verify step, bonus "
                                       "included)", ["head_version", "domain"], buckets=ACCEPT_BUCKETS, registry=r)
        self.verify_steps = Counter("ae_verify_steps", "Verify steps by head version and " + CONTEXT_HELP,
                                    ["head_version", "context"], registry=r)
        self.accepted_drafts = Counter("ae_accepted_drafts", "Draft tokens the target kept (bonus not counted) by "
                                       "head version and " + CONTEXT_HELP + "; accept length of a bucket = 1 + "
                                       "ae_accepted_drafts / ae_verify_steps", ["head_version", "context"],
                                       registry=r)
        self.plain_steps = Counter("ae_plain_steps", "Verify steps that verified no draft, by head version: the cost "
                                   "model found no draft worth its verify cost, so the step decoded plainly (of "
                                   "ae_verify_steps_total)", ["head_version"], registry=r)
        self.context_refused = Counter("ae_context_labels_refused", "by_context entries of a response whose bucket "
                                       "is not one of the gateway's context labels (a replica on other edges)",
                                       registry=r)
        self._context_heads: set[str] = set()
        self.tpot = Histogram("ae_time_per_output_token_seconds", "Per-request wall time per output token after "
                              "the first (the decode phase)", ["head_version"], buckets=TPOT_BUCKETS, registry=r)
        self.ttft = Histogram("ae_time_to_first_token_seconds", "Per-request wall time from the replica starting it "
                              "to its first token (the prefill; a prefix-cache hit shortens it)", ["head_version"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.tokens_per_s = Histogram("ae_tokens_per_second", "Per-request output tokens per second",
                                      ["head_version"], buckets=RATE_BUCKETS, registry=r)
        self.completion_tokens = Counter("ae_completion_tokens", "Output tokens", ["head_version"], registry=r)
        self.requests = Counter("ae_requests", "Requests by endpoint and HTTP status", ["endpoint", "status"],
                                registry=r)
        self.queue_depth = Gauge("ae_queue_depth", "Requests waiting for a free replica", registry=r)
        self.busy_replicas = Gauge("ae_busy_replicas", "Replicas decoding at least one request now", registry=r)
        self.inflight = Gauge("ae_requests_inflight", "Requests decoding now, on all replicas", registry=r)
        self.capacity = Gauge("ae_inflight_capacity", "Requests the replicas decode at once (the sum of their "
                              "max_inflight): ae_requests_inflight / this is the fleet's load", registry=r)
        self.replica_head = Gauge("ae_replica_head_info", "1 for the head version each replica serves",
                                  ["replica", "head_version"], registry=r)
        self.capture = Gauge("ae_capture_records", "Capture decisions per replica (hidden, tokens, skipped, "
                             "over_budget, opted_out)", ["replica", "kind"], registry=r)
        self.capture_dropped = Gauge("ae_capture_dropped", "Records the store writer dropped, for any reason",
                                     ["replica"], registry=r)
        self.capture_dropped_by_reason = Gauge("ae_capture_dropped_by_reason", "Records the store writer dropped, "
                                               "by reason (feature_store.writer.DROP_REASONS)", ["replica", "reason"],
                                               registry=r)
        self.store_state = Gauge("ae_capture_store_state", "1 for the store writer's state on each replica (ok, "
                                 "down, erroring, dead: feature_store.writer.WRITER_STATES)", ["replica", "state"],
                                 registry=r)
        self.store_written = Gauge("ae_capture_written", "Records the store acknowledged", ["replica"], registry=r)
        self.grammar_failed = Gauge("ae_grammar_failed", "Constrained requests a replica ended because their format "
                                    "could not go on mid-answer (a 400 error event): a schema the model cannot "
                                    "finish within its tokens, or a grammar engine fault", ["replica"], registry=r)
        self.verify_threads = Gauge("ae_replica_verify_threads", "Threads a replica's multi-row verify forwards "
                                    "compute on (CPU targets; 1 on a multi-CPU replica: the threaded fp16 kernel is "
                                    "missing or differs, see its log)", ["replica"], registry=r)
        self.replica_up = Gauge("ae_replica_up", "1 when the replica answered its status at the last scrape, 0 when "
                                "not (its actor died or is restarting)", ["replica"], registry=r)
        self.replica_failures = Counter("ae_replica_failures", "Requests whose replica failed while serving them "
                                        "(its stream raised: a Ray actor that died, crashed or restarted)",
                                        ["replica"], registry=r)
        self.replica_restarts = Counter("ae_replica_restarts", "Replica processes that replaced an earlier one (its "
                                        "status answered from a new pid: Ray restarted the actor)", ["replica"],
                                        registry=r)
        self._pids: dict[str, int] = {}
        self.fleet_reconciled = Counter("ae_fleet_reconciled", "Replicas found serving another head than they are "
                                        "routed as (a restarted actor), swapped back or re-routed", registry=r)
        self.fleet_reconcile_errors = Counter("ae_fleet_reconcile_errors", "Reconcile passes that failed",
                                              registry=r)
        self.canary_fraction = Gauge("ae_canary_fraction", "Share of requests routed to the canary head",
                                     registry=r)
        self.backends = BackendCollector()
        r.register(self.backends)
        self.holdback = HoldbackWindow()  # the holdback arm's and the served arm's newest requests per domain
        self.holdback_requests = Counter("ae_holdback_requests", "Finished requests by arm (holdback: the frozen "
                                         "baseline head; served: every other) and domain", ["arm", "domain"],
                                         registry=r)
        r.register(LoopGainCollector(self.holdback))

    def observe(self, spec: SpecMetrics, tokens: int) -> None:
        v = spec.head_version
        self.holdback_requests.labels(spec.arm, spec.domain or "none").inc()
        if tokens > 1:
            self.holdback.add(spec.domain, spec.arm, spec.tpot_s, spec.accept_length)
        self.accept_length.labels(v, spec.domain or "none").observe(spec.accept_length)
        self._observe_context(v, spec.by_context)
        self.plain_steps.labels(v).inc(spec.plain_steps)
        if tokens:
            self.ttft.labels(v).observe(spec.ttft_s)
            if tokens > 1:
                self.tpot.labels(v).observe(spec.tpot_s)
            self.tokens_per_s.labels(v).observe(spec.tokens_per_s)
            self.completion_tokens.labels(v).inc(tokens)

    def _observe_context(self, version: str, by_context) -> None:
        if version not in self._context_heads:  # every bucket's series at 0 from a head's first request on
            self._context_heads.add(version)
            for label in CONTEXT_LABELS:
                self.verify_steps.labels(version, label)
                self.accepted_drafts.labels(version, label)
        for label, steps, accepted in by_context:
            if label not in CONTEXT_LABELS:  # a replica on other edges: never a new series, never a failed request
                self.context_refused.inc()
                log.error("metrics: by_context label %r is not one of %s; not counted", label, CONTEXT_LABELS)
                continue
            self.verify_steps.labels(version, label).inc(steps)
            self.accepted_drafts.labels(version, label).inc(accepted)

    def refresh(self, statuses: Iterable[ServerStatus], waiting: int, busy: int, canary_fraction: float,
                replicas_up: Optional[Mapping[str, bool]] = None, inflight: int = 0, capacity: int = 0) -> None:
        """`statuses`: the replicas that answered; `replicas_up`: every replica by name, whether it answered;
        `inflight` / `capacity`: the router's requests in flight and what its replicas take at once."""
        for name, up in (replicas_up or {}).items():
            self.replica_up.labels(name).set(1 if up else 0)
            self.replica_failures.labels(name)  # a series at 0 from the start, so increase() sees the first failure
            self.replica_restarts.labels(name)
        self.queue_depth.set(waiting)
        self.busy_replicas.set(busy)
        self.inflight.set(inflight)
        self.capacity.set(capacity)
        self.canary_fraction.set(canary_fraction)
        self.replica_head.clear()
        self.store_state.clear()
        statuses = list(statuses)
        self.backends.update(statuses)
        for s in statuses:
            if s.pid is not None:
                if self._pids.get(s.replica, s.pid) != s.pid:
                    self.replica_restarts.labels(s.replica).inc()
                self._pids[s.replica] = s.pid
            self.replica_head.labels(s.replica, s.head_version).set(1)
            for kind in ("hidden", "tokens", "skipped", "over_budget", "opted_out"):
                self.capture.labels(s.replica, kind).set(s.capture.get(kind, 0))
            store = s.store or {}
            # the writer counts every record it drops (put refused, store down or refusing), also by reason;
            # without a writer, the server's count
            self.capture_dropped.labels(s.replica).set(store.get("dropped", s.capture.get("dropped_at_put", 0)))
            self.store_written.labels(s.replica).set(store.get("written", 0))
            self.grammar_failed.labels(s.replica).set(s.grammar_failed)
            if (s.info or {}).get("verify_threads") is not None:
                self.verify_threads.labels(s.replica).set(s.info["verify_threads"])
            for reason, n in (store.get("dropped_by_reason") or {}).items():
                self.capture_dropped_by_reason.labels(s.replica, reason).set(n)
            if store.get("state"):
                self.store_state.labels(s.replica, store["state"]).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
