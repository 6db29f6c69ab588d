"""The near-line trainer: continually fine-tunes a copy of the champion head on captured traffic.

Owns: the loop as named steps — poll the store → route (fresh, or held out with evidence "heldout") →
test (evidence "prequential": the records of the next batch replayed by the champion and the snapshots
gathering evidence, trainer/prequential.py) → pack a batch (fresh rows + replayed earlier traffic) →
one `train_step` → checkpoint → ack → candidate (a snapshot that gathers evidence from then on; or,
held out, the acceptance replay of candidate and champion on the same held-out records), written to
the registry — plus resuming from its checkpoint after a crash, following a champion change, the
drift signal, and a status for the gateway and the demo. Must not touch: serving, promotion (the
policy decides what serves; the trainer only proposes).

Delivery. The store delivers each record at least once. A record is acked only after the step
that trained on it (or the held-out pool that keeps it) has been checkpointed, so a crash loses
nothing: unacked records are delivered again, and at most one checkpoint interval of records is
trained twice. A record delivered again while this process still holds it is ignored.

Faults. A store error (StoreUnavailable, its StoreRejected included: Redis restarting or refusing,
a network blip) is ridden out: the loop backs off (capped, exponential) and tries the same pass
again, the status saying `degraded since <UTC time>: <error>` meanwhile, and carries on once the
store answers (an interrupted pass changed nothing that a retry repeats: a failed read delivered
nothing, a failed ack keeps its records to ack after the next checkpoint). Anything else, or more
than `store_max_errors` store errors in a row, ends `run` with the error (state `error: ...`): the
caller ends the process, and Ray restarts it.

TrainerActor (trainer/actor.py) is a thin async Ray actor around this class.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from adaptive_eagle.atomic import staging_dir
from adaptive_eagle.checkpoint import HeadMeta, load_head
from adaptive_eagle.draft_head import Eagle3DraftHead
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle.targets import Target, cpu_has_fast_bf16, load_target, resolve_device
from adaptive_eagle.trace import TraceRecord
from adaptive_eagle.versions import PLAIN
from feature_store.backend import StoreUnavailable
from feature_store.reader import StoreReader
from feature_store.schema import decode_record, encode_record
from trainer.buffer import ReplayBuffer, replay_rows
from trainer.config import NearlineConfig
from trainer.drift import DriftMonitor
from trainer.moe import MoEGrowth, candidate_meta
from trainer.prequential import EvidenceBook
from trainer.replay import ReplayScore, prequential_metrics, replay_heads, replay_metrics
from trainer.scaleout import DataParallelStep
from trainer.state import POOL_FILE, read_pool, read_state, restore_optimizer, write_pool, write_state
from trainer.step import StepConfig, StepStats, WarmupCosine, adamw, train_step
from trainer.traffic import TrafficRow, make_traffic_batch, row_from_record
from trainer.warm_start import head_from_traffic

log = logging.getLogger(__name__)

STATE = "state"
SEEN_REQUESTS = 50_000  # request ids remembered for de-duplication across restarts


class InjectedFault(RuntimeError):
    """Raised by a step that `inject_step_fault` armed (rehearsals inject it; nothing else raises it)."""


def is_heldout(request_id: str, percent: int) -> bool:
    """Stable split by request id: the same record is held out in every process and after restarts."""
    return int(hashlib.sha256(request_id.encode()).hexdigest()[:8], 16) % 100 < percent


def greedy_records(score: ReplayScore, records: list[TraceRecord]) -> int:
    """How many of the records a score replayed were greedy (temperature 0): their replay is exact."""
    replayed = {r.request_id for r in score.records}
    return sum(1 for r in records if r.request_id in replayed and r.sampling.temperature == 0)


def candidate_latency(trained: list[tuple[float, float, float]], eval_started: float, written: float) -> dict | None:
    """Trainer latency of a candidate: for each record it is the first candidate to have trained on (captured,
    read by the trainer, trained: unix seconds), the time from its capture to the candidate being written, and
    the medians of the stages it went through: capture to the trainer (the store and the poll), queued (waiting
    for a batch's worth of fresh tokens or for requests to drain), trained to evaluation (the candidate
    cadence), evaluation (replaying candidate and champion). None when no fresh record was trained."""
    if not trained:
        return None
    captured, read, stepped = (np.asarray(c, dtype=float) for c in zip(*trained))
    total = written - captured

    def r(x: float) -> float:
        return round(float(x), 1)

    return {"records": len(trained), "capture_to_candidate_p50": r(np.median(total)),
            "capture_to_candidate_min": r(total.min()), "capture_to_candidate_max": r(total.max()),
            "stages_p50": {"capture_to_trainer": r(np.median(read - captured)), "queued": r(np.median(stepped - read)),
                           "trained_to_evaluation": r(np.median(eval_started - stepped)),
                           "evaluation": r(written - eval_started)}}


def describe_latency(latency: dict) -> str:
    """One line: the capture-to-candidate time of a candidate's records and where the median went."""
    st = latency["stages_p50"]
    return (f"its {latency['records']} new records were captured {latency['capture_to_candidate_min']:.0f}-"
            f"{latency['capture_to_candidate_max']:.0f} s before (median {latency['capture_to_candidate_p50']:.0f} s: "
            f"{st['capture_to_trainer']:.0f} s to the trainer, {st['queued']:.0f} s queued, "
            f"{st['trained_to_evaluation']:.0f} s to the candidate's evaluation, {st['evaluation']:.0f} s evaluating)")


@dataclass(frozen=True)
class TrainerStatus:
    champion: str  # the version this trainer fine-tunes (registry name, "none": cold start)
    records_seen: int
    records_trained: int
    tokens_trained: int  # real tokens in trained batches (fresh + replay)
    tokens_received: int  # tokens of fresh training records received
    steps: int
    loss: float | None
    last_candidate: str | None
    candidates: int
    heldout: dict  # domain -> records kept for replay
    buffer: dict  # domain -> records in the replay buffer
    skipped: dict  # reason -> records refused
    duplicates: int
    regenerated_rows: int  # rows whose features came from a target forward here
    drift: dict
    # "starting" | "waiting" | "training" | "evaluating" (replaying candidates, test-then-train evidence included) |
    # "degraded since <UTC>: <error>" (retrying the store)
    # | "stopped" | "error: ..." (the loop ended with an error)
    state: str
    moe: dict | None = None  # MoE growth: domain -> expert, experts grown, low counts (None: moe_grow off)
    errors_total: int = 0  # errors the loop met in this process (store errors ridden out, and a fatal one)
    last_error: str | None = None  # "<type>: <message>" of the latest
    last_step_at: float | None = None  # unix seconds of the latest optimizer step in this process (None: none yet)
    pid: int | None = None  # the process the trainer runs in: a new one after Ray restarted the actor
    # the last candidate's trainer latency (`candidate_latency`): capture to candidate of the records it was the
    # first to train on, and where that time went (None: no candidate yet in this process)
    candidate_latency: dict | None = None
    aged_to_replay: int = 0  # records that waited past cfg.max_fresh_age_s and went to the replay buffer instead
    evidence: str = "heldout"  # how candidates are judged (cfg.evidence)
    gathering: list = None  # prequential: the snapshots gathering evidence (version, records, greedy, path)
    evidence_rows: int = 0  # prequential: evidence rows written by this process

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class NearlineTrainer:
    def __init__(self, cfg: NearlineConfig, *, target: Target | None = None, reader: StoreReader | None = None,
                 yield_to: Callable[[], bool] | None = None,
                 worker_target: Callable[[], Target] | None = None) -> None:
        """yield_to: called before each step; True makes the trainer wait (e.g. requests are queued on a
        machine whose cores it shares with a server). worker_target: with cfg.workers > 1, a picklable
        builder of each data-parallel worker's target (None: the workers load the trainer's target by name)."""
        self.cfg = cfg
        self.registry = HeadRegistry(cfg.registry)
        self.reader = reader or StoreReader(cfg.store, cfg.group, cfg.consumer)
        self.target = target
        self.yield_to = yield_to
        self.device = resolve_device(cfg.device)
        self.work_dir = Path(cfg.work_dir)
        self.buffer: ReplayBuffer[bytes] = ReplayBuffer(cfg.replay_per_domain, cfg.replay_max_bytes, cfg.seed)
        self.drift = DriftMonitor(cfg.drift_alpha, cfg.drift_drop, cfg.drift_min_records, cfg.drift_sustain,
                                  cfg.drift_boost)
        self.moe = MoEGrowth(cfg.moe_max_experts, cfg.moe_grow_after_records) if cfg.moe_grow else None
        self.heldout: dict[str, deque[TraceRecord]] = {}  # evidence "heldout": the held-out pools per domain
        # evidence "prequential": the snapshots gathering test-then-train evidence
        self.book = EvidenceBook(cfg.registry, cfg.tree, max_pending=cfg.max_pending_candidates,
                                 max_records=cfg.candidate_evidence_records)
        self.fresh: deque[tuple[str, TraceRecord]] = deque()
        self.held_ids: set[str] = set()  # delivered to us and not acked yet
        self.done_ids: list[str] = []  # consumed since the last checkpoint: acked after the next one
        # request ids trained on or held out (checkpointed with the state): a record the store delivers
        # again after a restart is recognised and skipped, not trained twice
        self.seen_requests: deque[str] = deque(maxlen=SEEN_REQUESTS)
        self._seen_set: set[str] = set()
        self.head: Eagle3DraftHead | None = None
        self.champion_head: Eagle3DraftHead | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.base = PLAIN
        self.counters = self._zero_counters()
        self.loss: float | None = None
        self.last_batch: dict = {}
        self._yield_since: float | None = None  # when the current stretch of yielding to requests began
        self.state = "starting"
        self.errors_total, self.last_error, self.last_step_at = 0, None, None
        self._step_fault: str | None = None  # inject_step_fault: the next step raises this
        self._store_errors = 0  # store errors in a row (the backoff's exponent)
        self._degraded_since: float | None = None  # unix seconds of the first of them
        self.events: deque[str] = deque(maxlen=200)  # drift and candidate lines, newest last
        # trainer latency: when each fresh record was read (delivery id -> unix s), and for the records trained
        # since the last candidate, (captured, read, trained) unix seconds; a candidate reports the spread
        self._read_at: dict[str, float] = {}
        self._trained_times: list[tuple[float, float, float]] = []
        self.last_candidate_latency: dict | None = None
        self._last_checkpoint = self._last_candidate_t = self._last_champion_check = time.monotonic()
        self._tokens_at_candidate = 0
        # data-parallel step (cfg.workers > 1): the worker group, started at the first step; whether it holds
        # self.head yet, and whether self.head is behind the workers' weights
        self.worker_target = worker_target
        self.target_spec: str | None = None  # what start() loaded the target from (the workers load the same)
        self.data_parallel: DataParallelStep | None = None
        self._pushed = self._stale = False

    @staticmethod
    def _zero_counters() -> dict:
        return {"records_seen": 0, "records_trained": 0, "tokens_trained": 0, "tokens_received": 0, "steps": 0,
                "duplicates": 0, "regenerated_rows": 0, "skipped": {}, "candidates": [], "window": None,
                "aged_to_replay": 0}

    # ---- start, resume, follow the champion ---------------------------------------------------------
    def start(self) -> None:
        if self.target is None:
            self.target_spec = self.cfg.target or self._champion_target_name()
            self.target = load_target(self.target_spec, purpose="train")
        champion = self.registry.champion()
        if self.prequential and (n := self.book.close_orphans("the trainer restarted (the snapshot's evidence "
                                                               "stops here)")):
            self._note(f"closed the evidence of {n} earlier snapshots: the trainer restarted")
        if (self.work_dir / STATE / "trainer.json").exists() and self._resume(champion):
            return
        self._reset_to(champion)

    @property
    def prequential(self) -> bool:
        return self.cfg.evidence == "prequential"

    def _champion_target_name(self) -> str:
        champion = self.registry.champion()
        if champion != PLAIN:
            return self.registry.version(champion).target_name
        if self.cfg.base_head:
            return load_head(self.cfg.base_head).meta.target_name
        return "smollm2-135m"

    def _load(self, version_or_dir: str) -> Eagle3DraftHead:
        if version_or_dir in self.registry:
            return self.registry.load(version_or_dir, self.target).head
        return load_head(version_or_dir, self.target).head

    def _reset_to(self, champion: str) -> None:
        """Start fine-tuning a fresh copy of `champion` (or the base head / a new head while it is 'none')."""
        self.base = champion
        self.book.close_all(f"the champion changed to {champion}")
        if champion != PLAIN:
            self.champion_head = self._load(champion).float().eval()
            self._set_head(copy.deepcopy(self.champion_head).train())
        else:
            self.champion_head = None
            self._set_head(self._load(self.cfg.base_head).float().train() if self.cfg.base_head else None)
        self.counters = {**self._zero_counters(), "records_seen": self.counters["records_seen"]}
        self._tokens_at_candidate = 0
        self._last_candidate_t = time.monotonic()
        self._trained_times = []  # what the old head trained on is not in the new one
        self.drift.reset(None if champion == PLAIN else champion)
        if self.moe is not None:  # the champion's domain -> expert map (head.json training.moe)
            self.moe.reset(self.registry.version(champion).training if champion != PLAIN else {})
        self._note(f"training from champion {champion}" + (" (base head " + self.cfg.base_head + ")"
                                                              if champion == PLAIN and self.cfg.base_head else ""))

    def _set_head(self, head: Eagle3DraftHead | None) -> None:
        self.head = None if head is None else head.to(self.device)
        self.opt = None if head is None else adamw(self.head, self.cfg.lr, self.cfg.weight_decay)
        self._pushed = self._stale = False  # a data-parallel worker group gets this head at the next step

    def follow_champion(self) -> bool:
        """Restart from the registry's champion when it changed (a promotion, a rollback). True if it did."""
        self._last_champion_check = time.monotonic()
        champion = self.registry.champion()
        if champion == self.base:
            return False
        self._note(f"champion changed {self.base} -> {champion}: restarting from it")
        self._reset_to(champion)
        return True

    # ---- poll and route --------------------------------------------------------------------------
    def poll(self, block_ms: int = 0) -> int:
        """Read what the store has; returns the number of new records taken."""
        taken = 0
        for d in self.reader.read(self.cfg.read_batch, block_ms):
            if d.id in self.held_ids:
                self.counters["duplicates"] += 1
                continue
            self.held_ids.add(d.id)
            if d.record.request_id in self._seen_set:  # delivered again after a restart: already used
                self.counters["duplicates"] += 1
                self.done_ids.append(d.id)
                continue
            taken += 1
            self.counters["records_seen"] += 1
            self._route(d.id, d.record)
        return taken

    def _remember(self, request_id: str) -> None:
        if len(self.seen_requests) == self.seen_requests.maxlen:
            self._seen_set.discard(self.seen_requests[0])
        self.seen_requests.append(request_id)
        self._seen_set.add(request_id)

    def _refusal(self, rec: TraceRecord) -> str | None:
        if rec.target_fingerprint != self.target.fingerprint:
            return "other target"
        if not rec.capture_consent:
            return "no capture consent"
        if len(rec.input_ids) < 4:
            return "fewer than 4 tokens"
        return None

    def _route(self, delivery_id: str, rec: TraceRecord) -> None:
        reason = self._refusal(rec)
        if reason is not None:
            skipped = self.counters["skipped"]
            skipped[reason] = skipped.get(reason, 0) + 1
            self.done_ids.append(delivery_id)
            return
        if rec.steps:
            event = self.drift.observe(rec.domain, rec.accept_length_mean, rec.head_version)
            if event is not None:
                self._note(event.describe())
            if self.moe is not None:
                self.moe.observe(rec, self.drift)
        if not self.prequential and is_heldout(rec.request_id, self.cfg.heldout_percent):
            pool = self.heldout.setdefault(rec.domain or "", deque(maxlen=self.cfg.heldout_per_domain))
            pool.append(rec)
            self._remember(rec.request_id)
            self.done_ids.append(delivery_id)  # kept in the checkpoint's pool
        else:
            self.fresh.append((delivery_id, rec))
            self._read_at[delivery_id] = time.time()
            self.counters["tokens_received"] += min(len(rec.input_ids), self.cfg.max_len)

    # ---- one step ----------------------------------------------------------------------------------
    def _row(self, rec: TraceRecord) -> TrafficRow:
        return row_from_record(rec, self.head.cfg.aux_layer_ids, self.cfg.positions, self.cfg.max_len)

    def _take_fresh(self) -> list[tuple[str, TraceRecord]]:
        """Fresh records for one batch, oldest first: padded tokens within the batch's fresh share (the
        replay rows take the rest)."""
        limit = self.cfg.batch_tokens * (1 - self.cfg.replay_ratio)
        taken: list[tuple[str, TraceRecord]] = []
        longest = 0
        while self.fresh:
            n = min(len(self.fresh[0][1].input_ids), self.cfg.max_len)
            if taken and max(longest, n) * (len(taken) + 1) > limit:
                break
            taken.append(self.fresh.popleft())
            longest = max(longest, n)
        return taken

    def _fresh_tokens(self) -> int:
        return sum(min(len(r.input_ids), self.cfg.max_len) for _, r in self.fresh)

    def ready(self) -> str | None:
        """What the next step would train on: "fresh", "replay" (idle: more passes over the buffer), or None."""
        if self.head is None:
            return None
        if self.fresh and self._fresh_tokens() >= self.cfg.min_fresh_tokens:
            return "fresh"
        budget = self.cfg.max_passes * self.counters["tokens_received"]
        if len(self.buffer) and self.counters["tokens_trained"] < budget:
            return "replay"
        return None

    def train_once(self, force: bool = False) -> StepStats | None:
        """One optimizer step on fresh traffic plus replay rows, or on replay alone while idle. `force`
        trains on whatever fresh records there are."""
        if self.head is None:
            self._maybe_cold_start()
            if self.head is None:
                return None
        self._age_out_fresh()
        kind = "fresh" if force and self.fresh else self.ready()
        if kind is None:
            return None
        fresh = self._take_fresh() if kind == "fresh" else []
        self._test([r for _, r in fresh])
        if fresh:
            replayed = self._replay(replay_rows(len(fresh), self.cfg.replay_ratio))
        else:  # idle: another pass over earlier traffic
            replayed = self._replay_only()
        rows = [self._row(r) for _, r in fresh] + [self._row(r) for r in replayed]
        cut = {r.request_id for r in rows if not r.trained_positions}  # e.g. a prompt longer than max_len
        if untrainable := sum(1 for r in rows if not r.trained_positions):
            rows = [r for r in rows if r.trained_positions]
            self.counters["skipped"]["no_trained_position_within_max_len"] = (
                self.counters["skipped"].get("no_trained_position_within_max_len", 0) + untrainable)
        if self._step_fault is not None:
            message, self._step_fault = self._step_fault, None
            raise InjectedFault(message)
        self.state = "training"
        if self.moe is not None and (grown := self.moe.grow(self.head, self.target)) is not None:
            self._set_head(grown.head.float().train())  # a new optimizer over the grown head's parameters
            self._note(grown.describe())
        step = self.counters["steps"]
        if not rows:  # every record of the batch was cut before its first trained token: consumed, nothing learned
            stats = StepStats(step=step, lr=float(self.opt.param_groups[0]["lr"]), loss=0.0, grad_norm=0.0, tokens=0,
                              step_loss=(), step_correct=(), step_count=())
            tokens, regenerated = 0, 0
        elif self.cfg.workers > 1:
            stats, tokens, regenerated = self._step_data_parallel(rows, step)
        else:
            tb = make_traffic_batch(self.target, self.head, rows, self.device)
            with self.moe.supervise(self.head, tb) if self.moe is not None else nullcontext() as extra:
                stats = train_step(self.head, tb.batch, self.opt, self._schedule(), self._step_config(), step=step,
                                   extra_loss=extra)
            tokens, regenerated = tb.tokens, tb.regenerated
        self.counters["steps"] += 1
        self.last_step_at = time.time()
        self.counters["tokens_trained"] += tokens
        self.counters["regenerated_rows"] += regenerated
        self.loss = stats.loss
        self.last_batch = {"fresh": len(fresh), "replay": len(replayed), "tokens": tokens, "regenerated": regenerated}
        trained_at = time.time()
        for delivery_id, rec in fresh:
            read_at = self._read_at.pop(delivery_id, trained_at)
            self._trained_times.append((min(rec.created_at, read_at), read_at, trained_at))
            if rec.request_id not in cut:  # a record with nothing to train on is not replayed either
                payload = encode_record(rec, self.cfg.store.codec)
                self.buffer.add(payload, rec.domain, len(payload))
            self.done_ids.append(delivery_id)
            self._remember(rec.request_id)
            self.counters["records_trained"] += 1
            self._widen_window(rec)
        return stats

    def _age_out_fresh(self) -> None:
        """Behind the traffic: records that waited longer than cfg.max_fresh_age_s for a fresh step go into the
        replay buffer (acked after the next checkpoint, trained when replay samples them), counted as
        `aged_to_replay`. Fresh steps then train on recent traffic, and the queue (and its memory) is bounded by
        what arrives in that time."""
        now = time.time()
        aged = []
        while self.fresh and now - self._read_at.get(self.fresh[0][0], now) > self.cfg.max_fresh_age_s:
            delivery_id, rec = self.fresh.popleft()
            aged.append(rec)
            self._read_at.pop(delivery_id, None)
            payload = encode_record(rec, self.cfg.store.codec)
            self.buffer.add(payload, rec.domain, len(payload))
            self.done_ids.append(delivery_id)
            self._remember(rec.request_id)
            self.counters["aged_to_replay"] = self.counters.get("aged_to_replay", 0) + 1  # absent: older checkpoint
        self._test(aged)

    def _test(self, records: list[TraceRecord]) -> None:
        """Test, then train: the snapshots gathering evidence replay `records` (with the champion) before any
        step trains on them."""
        if self.prequential and records:
            if self.book.open:
                self.state = "evaluating"
            self.book.test(records, self.champion_head, self.target)

    def inject_step_fault(self, message: str) -> None:
        """Fault injection for rehearsals: the next step raises InjectedFault(message) after taking its records,
        as a bug in a step would (the loop ends, the process with it, and the records come again)."""
        self._step_fault = message

    def _step_data_parallel(self, rows: list[TrafficRow], step: int) -> tuple[StepStats, int, int]:
        """The step on the worker group (started at the first call; given the head whenever it changed)."""
        if self.data_parallel is None:
            by_position = self.cfg.sequence_parallel > 1
            self.data_parallel = DataParallelStep(
                self.cfg.workers, device=self.device.type, storage=self.work_dir / "ray-train",
                target=self.target_spec or str(self.target.path), target_builder=self.worker_target,
                cpus_per_worker=self.cfg.worker_cpus, split="positions" if by_position else "rows")
            self._note(f"sequence-parallel step on {self.cfg.workers} Ray Train workers (rows split by position, "
                       "ring attention)" if by_position else f"data-parallel step on {self.cfg.workers} Ray Train "
                       "workers (DDP)")
        if not self._pushed:
            self.data_parallel.load(self.head, self.opt, self.cfg.lr, self.cfg.weight_decay)
            self._pushed = True
        out = self.data_parallel.step(rows, step, self._schedule()(step), self._step_config())
        self._stale = True
        return out

    def sync_head(self) -> None:
        """Bring self.head (and the optimizer's moments) level with the workers' after data-parallel steps."""
        if not self._stale or self.data_parallel is None:
            return
        state = self.data_parallel.state()
        weights = {**state["state"], "embed_tokens.weight": self.head.embed_tokens.weight.detach()}
        self.head.load_state_dict(weights)
        self.opt.load_state_dict(state["optimizer"])
        self._stale = False

    def _replay(self, n: int) -> list[TraceRecord]:
        return [decode_record(p) for _, p in self.buffer.sample(n, self.drift.weights())]

    def _replay_only(self) -> list[TraceRecord]:
        """Buffer records filling one batch (padded tokens <= batch_tokens), domains drawn by drift weight."""
        out: list[TraceRecord] = []
        longest = 0
        for rec in self._replay(64):
            n = min(len(rec.input_ids), self.cfg.max_len)
            if out and max(longest, n) * (len(out) + 1) > self.cfg.batch_tokens:
                break
            out.append(rec)
            longest = max(longest, n)
        return out

    def _schedule(self) -> WarmupCosine:
        # constant after warmup: traffic never ends, so there is no horizon to decay towards
        return WarmupCosine(lr=self.cfg.lr, total_steps=1, warmup_steps=self.cfg.warmup_steps, min_lr_ratio=1.0)

    def _step_config(self) -> StepConfig:
        bf16 = self.cfg.bf16
        if bf16 is None:  # the offline trainer's policy: CUDA, or a CPU that multiplies bf16 in hardware
            bf16 = self.device.type == "cuda" or cpu_has_fast_bf16()
        return StepConfig(ttt_steps=self.cfg.ttt_steps, step_decay=self.cfg.step_decay,
                          max_loss_rows=self.cfg.max_loss_rows, grad_clip=self.cfg.grad_clip, bf16=bf16)

    def _widen_window(self, rec: TraceRecord) -> None:
        w = self.counters["window"] or {"first": rec.created_at, "last": rec.created_at, "domains": {}}
        w["first"], w["last"] = min(w["first"], rec.created_at), max(w["last"], rec.created_at)
        w["domains"][rec.domain or "untagged"] = w["domains"].get(rec.domain or "untagged", 0) + 1
        self.counters["window"] = w

    def _maybe_cold_start(self) -> None:
        """Champion 'none' and no base head: build a head from the traffic's own tokens."""
        records = [r for _, r in self.fresh] + [r for pool in self.heldout.values() for r in pool]
        if len(records) < self.cfg.cold_start_records:
            return
        head, vocab = head_from_traffic(self.target, [r.input_ids for r in records], seed=self.cfg.seed)
        self._set_head(head.float().train())
        self._note(f"cold start: new head with a {vocab.target_ids.numel()}-token draft vocabulary from "
                   f"{len(records)} records ({vocab.coverage:.1%} coverage)")

    # ---- checkpoint and ack ------------------------------------------------------------------------
    def checkpoint(self) -> None:
        """Write the state atomically, then ack every record it covers."""
        self.sync_head()
        if self.head is not None:
            with staging_dir(self.work_dir / STATE, overwrite=True) as d:
                meta = {"base": self.base, "counters": self.counters, "buffer_seen": self.buffer.seen(),
                        "buffer_priorities": self.buffer.priorities(),
                        "tokens_at_candidate": self._tokens_at_candidate, "saved_at": time.time(),
                        "seen_requests": list(self.seen_requests),
                        "moe": self.moe.state() if self.moe is not None else None}
                write_state(d, self.head, self.opt, meta)
                heldout = [(d_, encode_record(r, self.cfg.store.codec)) for d_, pool in self.heldout.items()
                           for r in pool]
                write_pool(d / POOL_FILE, self.buffer.items(), heldout)
        if self.done_ids:
            self.reader.ack(self.done_ids)
            self.held_ids.difference_update(self.done_ids)
            self.done_ids = []
        self._last_checkpoint = time.monotonic()

    def _resume(self, champion: str) -> bool:
        """Restore the checkpoint if it was trained from the current champion; False otherwise."""
        d = self.work_dir / STATE
        try:
            head, meta, opt_tensors = read_state(d, self.target)
        except (OSError, ValueError, KeyError) as e:
            self._note(f"checkpoint in {d} refused ({e}); starting from champion {champion}")
            return False
        if meta.get("base") != champion:
            self._note(f"checkpoint was trained from {meta.get('base')}, champion is {champion}: starting over")
            return False
        self._reset_to(champion)
        self._set_head(head.float().train())
        restore_optimizer(self.opt, opt_tensors, meta)
        self.counters = meta["counters"]
        self._tokens_at_candidate = meta.get("tokens_at_candidate", 0)
        if self.moe is not None:
            self.moe.restore(meta.get("moe"))
        for rid in meta.get("seen_requests", []):
            self._remember(rid)
        replay, heldout = read_pool(d / POOL_FILE)
        self.buffer.restore([(dom, p, len(p)) for dom, p in replay], meta.get("buffer_seen", {}),
                            meta.get("buffer_priorities"))  # None in checkpoints from before priority keys
        for dom, p in heldout:
            self.heldout.setdefault(dom, deque(maxlen=self.cfg.heldout_per_domain)).append(decode_record(p))
        self._note(f"resumed from checkpoint: step {self.counters['steps']}, "
                   f"{self.counters['tokens_trained']} tokens trained")
        return True

    # ---- candidates --------------------------------------------------------------------------------
    def candidate_due(self) -> bool:
        trained = self.counters["tokens_trained"] - self._tokens_at_candidate
        if self.head is None or trained < self.cfg.min_candidate_tokens:
            return False
        if not self.prequential and sum(len(p) for p in self.heldout.values()) < self.cfg.min_candidate_heldout:
            return False
        minutes = (time.monotonic() - self._last_candidate_t) / 60
        return trained >= self.cfg.candidate_every_tokens or minutes >= self.cfg.candidate_every_minutes

    def heldout_records(self) -> list[TraceRecord]:
        return [r for _, pool in sorted(self.heldout.items()) for r in pool]

    def evaluate(self, head: Eagle3DraftHead) -> tuple[ReplayScore, ReplayScore | None, dict]:
        """Replay `head` and the champion on the same held-out records."""
        heads = {"candidate": head}
        if self.champion_head is not None:
            heads["champion"] = self.champion_head
        report = replay_heads(heads, self.heldout_records(), self.target, self.cfg.tree)
        return report.scores["candidate"], report.scores.get("champion"), report.skipped

    def write_candidate(self) -> str | None:
        """Save the current head as a candidate version. Evidence "heldout": with its replay scores next to the
        champion's on the held-out records. "prequential": as a snapshot that gathers its evidence from the
        records read from now on (and those still waiting for a step), which the policy re-reads."""
        self.state = "evaluating"
        self.sync_head()
        cand = copy.deepcopy(self.head).to(torch.bfloat16).float().eval()  # exactly what the registry stores
        t_eval = time.time()
        if self.prequential:
            replay = prequential_metrics(self.base, self.cfg.tree)
            records = list(self.book.recent)
            if self.moe is not None and (summary := self.book.replay_summary()) is not None:
                self.moe.note_replay(summary)
        else:
            score, champ, skipped = self.evaluate(cand)
            records = self.heldout_records()
            replay = replay_metrics(score, champ, self.base, self.cfg.tree, skipped, greedy_records(score, records))
            if self.moe is not None:
                self.moe.note_replay(score.summary())
        latency = candidate_latency(self._trained_times, t_eval, time.time())
        name = self._candidate_name()
        moe_training, moe_metrics = candidate_meta(cand, self.target, records, self.moe)
        training = {"trainer": "nearline", "steps": self.counters["steps"], "tokens": self.counters["tokens_trained"],
                    "lr": self.cfg.lr, "positions": self.cfg.positions, "replay_ratio": self.cfg.replay_ratio,
                    **moe_training}
        meta = HeadMeta.new(name, self.target.name, self.target.fingerprint,
                            parent=None if self.base == PLAIN else self.base,
                            data={"source": "captured traffic", "window": self.counters["window"],
                                  "records_trained": self.counters["records_trained"], "latency_s": latency},
                            training=training, metrics={"replay": replay, **moe_metrics})
        self.registry.register(cand, meta)
        if self.prequential:
            self.book.add(name, cand, self.base, {"steps": training["steps"], "tokens": training["tokens"],
                                                  "records_trained": self.counters["records_trained"]})
        self.counters["candidates"].append(name)
        self._tokens_at_candidate = self.counters["tokens_trained"]
        self._last_candidate_t = time.monotonic()
        self._trained_times = []
        self.last_candidate_latency = latency
        if self.prequential:
            judged = (f"snapshot gathering test-then-train evidence against {self.base} "
                      f"({len(self.book.open)} open)")
        else:
            gain = f" vs champion {champ.mean:.3f}" if champ is not None else " vs plain decoding 1.000"
            judged = f"replayed accept length {score.mean:.3f}{gain} on {len(score.records)} records"
        self._note(f"candidate {name}: {judged}" + (f"; {describe_latency(latency)}" if latency else ""))
        return name

    def _candidate_name(self) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        name, k = f"{self.cfg.candidate_prefix}-{stamp}", 1
        while name in self.registry:
            k += 1
            name = f"{self.cfg.candidate_prefix}-{stamp}-{k}"
        return name

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None, budget_s: float | None = None) -> TrainerStatus:
        """Tail the store and train until `stop` is set or `budget_s` seconds passed; checkpoints on exit.
        Store errors are ridden out (`_back_off`); any other error is raised, state `error: ...`."""
        stop = stop or threading.Event()
        t_end = time.monotonic() + budget_s if budget_s is not None else None
        started = self.state != "starting"
        try:
            if not started:
                self.start()
                started = True
            while not stop.is_set() and (t_end is None or time.monotonic() < t_end):
                try:
                    self.tick()
                except StoreUnavailable as e:
                    self._back_off(e, stop)
                else:
                    self._store_answers()
        except BaseException as e:
            self.state = f"error: {type(e).__name__}: {e}"
            if started:
                try:
                    self._checkpoint_on_exit()
                except Exception:  # the loop's own error is the one to raise
                    log.exception("checkpoint after the loop's error failed")
            self._count_error(e)  # last: the loop's own error is the last error
            raise
        self._checkpoint_on_exit()
        self.state = "stopped"
        return self.status()

    def _count_error(self, e: BaseException) -> None:
        self.errors_total += 1
        self.last_error = f"{type(e).__name__}: {e}"

    def _back_off(self, e: StoreUnavailable, stop: threading.Event) -> None:
        """A store error: counted, the state says degraded, and the loop waits before its next pass (capped
        exponential backoff, cut short by `stop`). One more than cfg.store_max_errors in a row is raised."""
        self._store_errors += 1
        self._degraded_since = self._degraded_since or time.time()
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._degraded_since))
        if self._store_errors > self.cfg.store_max_errors:  # counted by run() as the loop's own error
            raise RuntimeError(f"the store failed {self._store_errors} times in a row since {since}; "
                               f"last: {type(e).__name__}: {e}") from e
        self._count_error(e)
        if self._store_errors == 1:
            self._note(f"store error, retrying with backoff: {self.last_error}")
        self.state = f"degraded since {since}: {self.last_error}"
        delay = self.cfg.store_backoff_initial_s * 2 ** min(self._store_errors - 1, 30)
        stop.wait(min(delay, self.cfg.store_backoff_max_s))

    def _store_answers(self) -> None:
        """A pass went through: end a degraded stretch (the pass itself set the state)."""
        if self._degraded_since is not None:
            self._note(f"store answers again after {self._store_errors} errors in "
                       f"{time.time() - self._degraded_since:.1f} s")
            self._store_errors, self._degraded_since = 0, None

    def _checkpoint_on_exit(self) -> None:
        """The last checkpoint. The state is on disk before the ack; if the store is down the ack is left
        undone (the records come again after a restart and are recognised as already used)."""
        try:
            self.checkpoint()
        except StoreUnavailable as e:
            self._count_error(e)
            self._note(f"last checkpoint written, {len(self.done_ids)} records left unacked: {self.last_error}")

    def tick(self) -> None:
        """One pass of the loop: champion check, poll, maybe a step, maybe a checkpoint or a candidate."""
        now = time.monotonic()
        if now - self._last_champion_check >= self.cfg.champion_check_s:
            self.follow_champion()
        self.poll(block_ms=0 if self.ready() else self.cfg.poll_ms)
        if self._yielding():
            self.state = "waiting"
            time.sleep(self.cfg.poll_ms / 1000)
            return
        self._yield_since = None
        if self.train_once() is None:
            self.state = "waiting"
        if time.monotonic() - self._last_checkpoint >= self.cfg.checkpoint_every_s:
            self.checkpoint()
        if self.candidate_due():
            self.write_candidate()
            self.checkpoint()

    def _yielding(self) -> bool:
        """Wait while requests queue (yield_to), but never longer than max_yield_s at a stretch: under
        constant load the trainer still takes one step per interval, so neither side starves."""
        if self.yield_to is None or not self.yield_to():
            return False
        now = time.monotonic()
        if self._yield_since is None:
            self._yield_since = now
        return now - self._yield_since < self.cfg.max_yield_s

    def _note(self, line: str) -> None:
        log.info(line)
        self.events.append(f"{time.strftime('%H:%M:%S')} {line}")

    def status(self) -> TrainerStatus:
        c = self.counters
        return TrainerStatus(
            champion=self.base, records_seen=c["records_seen"], records_trained=c["records_trained"],
            tokens_trained=c["tokens_trained"], tokens_received=c["tokens_received"], steps=c["steps"],
            loss=self.loss, last_candidate=c["candidates"][-1] if c["candidates"] else None,
            candidates=len(c["candidates"]), heldout={d or "untagged": len(p) for d, p in self.heldout.items()},
            buffer=self.buffer.domains(), skipped=dict(c["skipped"]), duplicates=c["duplicates"],
            regenerated_rows=c["regenerated_rows"], drift=self.drift.table(), state=self.state,
            moe=self.moe.status() if self.moe is not None else None, errors_total=self.errors_total,
            last_error=self.last_error, last_step_at=self.last_step_at, pid=os.getpid(),
            candidate_latency=self.last_candidate_latency, aged_to_replay=c.get("aged_to_replay", 0),
            evidence=self.cfg.evidence, gathering=self.book.status(), evidence_rows=self.book.rows_written)

    def close(self) -> None:
        if self.data_parallel is not None:
            self.data_parallel.close()
            self.data_parallel = None
        self.reader.close()


__all__ = ["InjectedFault", "NearlineTrainer", "TrainerStatus", "candidate_latency", "describe_latency", "is_heldout"]
