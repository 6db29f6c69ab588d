"""Ingest: what the near-line trainer takes from the store, and what it keeps of it until a step uses it.

Owns: tailing the store through its StoreReader (a delivery held here is not taken twice; a request id
already trained on or held out is recognised after a restart and skipped), routing each record (refused
and counted: another target, no capture consent, fewer than 4 tokens; observed by the drift monitor and
MoE growth; then held out for evidence "heldout", by a stable split of its request id, or queued fresh),
the fresh queue (a batch's worth drawn oldest first; records that waited past max_fresh_age_s aged into
the replay buffer), the replay buffer (fed what was trained or aged; sampled by drift weight; its share of the rows, owed
where a long row leaves no room beside it and then paid by a step on replay alone), the
held-out pools, and the acks owed: a record used since the last checkpoint is acked only when the
trainer says its checkpoint covers it (`ack_done`).

Must not touch: the head, the optimizer, the registry, the state on disk (trainer/checkpointing.py writes
what `NearlineTrainer` hands it), evidence (the trainer has records tested before a step trains on them).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from typing import Callable

from adaptive_eagle.trace import TraceRecord
from feature_store.reader import StoreReader
from feature_store.schema import decode_record, encode_record
from trainer.buffer import ReplayBuffer, replay_rows
from trainer.config import NearlineConfig
from trainer.drift import DriftMonitor
from trainer.moe import MoEGrowth

log = logging.getLogger(__name__)

SEEN_REQUESTS = 50_000  # request ids remembered for de-duplication across restarts


def is_heldout(request_id: str, percent: int) -> bool:
    """Stable split by request id: the same record is held out in every process and after restarts."""
    return int(hashlib.sha256(request_id.encode()).hexdigest()[:8], 16) % 100 < percent


def refusal(rec: TraceRecord, fingerprint: str) -> str | None:
    """Why the trainer of a target with this fingerprint cannot use `rec` (the `skipped` counter's key), or None."""
    if rec.target_fingerprint != fingerprint:
        return "other target"
    if not rec.capture_consent:
        return "no capture consent"
    if len(rec.input_ids) < 4:
        return "fewer than 4 tokens"
    return None


class Intake:
    """The trainer's side of the store: deliveries in, records queued, held out or kept for replay, acks out.
    `counters` is the trainer's counters dict (shared, reset in place): this role adds records_seen, duplicates,
    skipped, tokens_received, aged_to_replay and records_trained."""

    def __init__(self, cfg: NearlineConfig, reader: StoreReader, counters: dict, drift: DriftMonitor,
                 moe: MoEGrowth | None, note: Callable[[str], None]) -> None:
        self.cfg, self.reader, self.counters, self.drift, self.moe, self._note = cfg, reader, counters, drift, moe, note
        self.buffer: ReplayBuffer[bytes] = ReplayBuffer(cfg.replay_per_domain, cfg.replay_max_bytes, cfg.seed)
        self.heldout: dict[str, deque[TraceRecord]] = {}  # evidence "heldout": the held-out pools per domain
        self.fresh: deque[tuple[str, TraceRecord]] = deque()  # (delivery id, record), oldest first
        self.held_ids: set[str] = set()  # delivered to us and not acked yet
        self.done_ids: list[str] = []  # consumed since the last checkpoint: acked after the next one
        # request ids trained on or held out (checkpointed with the state): a record the store delivers
        # again after a restart is recognised and skipped, not trained twice
        self.seen_requests: deque[str] = deque(maxlen=SEEN_REQUESTS)
        self._seen_set: set[str] = set()
        self.read_at: dict[str, float] = {}  # delivery id -> unix s the fresh record was read (trainer latency)
        # replay rows owed to the fresh rows trained (cfg.replay_ratio, counted over steps): what no batch had room
        # for (a long session fills a batch alone) is paid by a step on replay alone
        self.replay_owed = 0.0

    # ---- poll and route ------------------------------------------------------------------------------
    def poll(self, block_ms: int, fingerprint: str) -> int:
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
            self._route(d.id, d.record, fingerprint)
        return taken

    def remember(self, request_id: str) -> None:
        if len(self.seen_requests) == self.seen_requests.maxlen:
            self._seen_set.discard(self.seen_requests[0])
        self.seen_requests.append(request_id)
        self._seen_set.add(request_id)

    def _route(self, delivery_id: str, rec: TraceRecord, fingerprint: str) -> None:
        reason = refusal(rec, fingerprint)
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
        if self.cfg.evidence != "prequential" and is_heldout(rec.request_id, self.cfg.heldout_percent):
            pool = self.heldout.setdefault(rec.domain or "", deque(maxlen=self.cfg.heldout_per_domain))
            pool.append(rec)
            self.remember(rec.request_id)
            self.done_ids.append(delivery_id)  # kept in the checkpoint's pool
        else:
            self.fresh.append((delivery_id, rec))
            self.read_at[delivery_id] = time.time()
            self.counters["tokens_received"] += min(len(rec.input_ids), self.cfg.max_len)

    # ---- what the next step trains on --------------------------------------------------------------------
    def fresh_tokens(self) -> int:
        return sum(min(len(r.input_ids), self.cfg.max_len) for _, r in self.fresh)

    def ready(self) -> str | None:
        """What a step would train on now: "fresh", "owed" (replay alone: the replay share the fresh batches had
        no room for), "replay" (idle: more passes over the buffer, within max_passes of the tokens received), or
        None."""
        if self.fresh and self.fresh_tokens() >= self.cfg.min_fresh_tokens:
            return "owed" if self.replay_owed >= 1 and len(self.buffer) else "fresh"
        budget = self.cfg.max_passes * self.counters["tokens_received"]
        if len(self.buffer) and self.counters["tokens_trained"] < budget:
            return "replay"
        return None

    def take_fresh(self) -> list[tuple[str, TraceRecord]]:
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

    def replay(self, n: int) -> list[TraceRecord]:
        """n records drawn from the replay buffer, domains weighted by the drift monitor."""
        return [decode_record(p) for _, p in self.buffer.sample(n, self.drift.weights())]

    def replay_for(self, fresh: list[TraceRecord]) -> list[TraceRecord]:
        """Replay rows beside `fresh` ones: the rows owed so far (cfg.replay_ratio of the fresh rows, fractions
        carried over), as many as the batch has room for; the rest stay owed. Nothing is owed while the buffer is
        empty (no earlier traffic to keep)."""
        if not len(self.buffer):
            return []
        self.replay_owed += replay_rows(len(fresh), self.cfg.replay_ratio)
        out = self.replay_beside(fresh, int(self.replay_owed))
        self.replay_owed -= len(out)
        return out

    def replay_beside(self, fresh: list[TraceRecord], n: int) -> list[TraceRecord]:
        """Up to n replay records to train beside `fresh` ones, the batch's padded size (every row pads to the
        longest) kept within batch_tokens: a drawn record too long to fit is left out of this batch (it stays
        in the buffer). Without this, one long session drawn beside short rows would pad them all to its length."""
        longest = max((min(len(r.input_ids), self.cfg.max_len) for r in fresh), default=0)
        out: list[TraceRecord] = []
        for rec in self.replay(n):
            m = min(len(rec.input_ids), self.cfg.max_len)
            if max(longest, m) * (len(fresh) + len(out) + 1) <= self.cfg.batch_tokens:
                out.append(rec)
                longest = max(longest, m)
        return out

    def replay_batch(self) -> list[TraceRecord]:
        """Buffer records filling one batch (padded tokens <= batch_tokens), domains drawn by drift weight; they
        pay the replay rows owed (never below none owed)."""
        out: list[TraceRecord] = []
        longest = 0
        for rec in self.replay(64):
            n = min(len(rec.input_ids), self.cfg.max_len)
            if out and max(longest, n) * (len(out) + 1) > self.cfg.batch_tokens:
                break
            out.append(rec)
            longest = max(longest, n)
        self.replay_owed = max(0.0, self.replay_owed - len(out))
        return out

    def age_out(self) -> list[TraceRecord]:
        """Behind the traffic: records that waited longer than cfg.max_fresh_age_s for a fresh step go into the
        replay buffer (acked after the next checkpoint, trained when replay samples them), counted as
        `aged_to_replay`. Fresh steps then train on recent traffic, and the queue (and its memory) is bounded by
        what arrives in that time. Returns the records aged out (oldest first)."""
        now = time.time()
        aged = []
        while self.fresh and now - self.read_at.get(self.fresh[0][0], now) > self.cfg.max_fresh_age_s:
            delivery_id, rec = self.fresh.popleft()
            aged.append(rec)
            self.read_at.pop(delivery_id, None)
            self._keep_for_replay(rec)
            self.done_ids.append(delivery_id)
            self.remember(rec.request_id)
            self.counters["aged_to_replay"] = self.counters.get("aged_to_replay", 0) + 1  # absent: older checkpoint
        return aged

    def consumed(self, fresh: list[tuple[str, TraceRecord]], cut: set[str],
                 trained_at: float) -> list[tuple[float, float, float]]:
        """The fresh records a step trained on: kept for replay (unless `cut`: nothing in it to train on), owed an
        ack, remembered, counted. Returns each one's (captured, read, trained) unix seconds."""
        times = []
        for delivery_id, rec in fresh:
            read_at = self.read_at.pop(delivery_id, trained_at)
            times.append((min(rec.created_at, read_at), read_at, trained_at))
            if rec.request_id not in cut:  # a record with nothing to train on is not replayed either
                self._keep_for_replay(rec)
            self.done_ids.append(delivery_id)
            self.remember(rec.request_id)
            self.counters["records_trained"] += 1
        return times

    def _keep_for_replay(self, rec: TraceRecord) -> None:
        payload = encode_record(rec, self.cfg.store.codec)
        self.buffer.add(payload, rec.domain, len(payload))

    # ---- held out, cold start, acks, resume --------------------------------------------------------------
    def heldout_records(self) -> list[TraceRecord]:
        return [r for _, pool in sorted(self.heldout.items()) for r in pool]

    def heldout_count(self) -> int:
        return sum(len(p) for p in self.heldout.values())

    def waiting_records(self) -> list[TraceRecord]:
        """Every record held here unused: the fresh queue, then the held-out pools (a cold start's vocabulary)."""
        return [r for _, r in self.fresh] + [r for pool in self.heldout.values() for r in pool]

    def ack_done(self) -> None:
        """Ack every record consumed since the last checkpoint (call after the checkpoint that covers them). A
        failed ack (StoreUnavailable) keeps them owed for the next one."""
        if self.done_ids:
            self.reader.ack(self.done_ids)
            self.held_ids.difference_update(self.done_ids)
            self.done_ids = []

    def restore(self, seen_requests: list[str], replay: list[tuple[str, bytes]], buffer_seen: dict,
                buffer_priorities: dict | None, heldout: list[tuple[str, TraceRecord]]) -> None:
        """Take back what a checkpoint kept: the request ids already used, the replay buffer with its keys (None:
        a checkpoint from before priority keys) and the held-out pools."""
        dropped = self.buffer.restore([(dom, p, len(p)) for dom, p in replay], buffer_seen, buffer_priorities)
        if dropped:
            log.warning("replay buffer checkpoint: %d held records at their domain's threshold dropped "
                        "(written by a trainer that drew the same keys again after a restart)", dropped)
        for rid in seen_requests:
            self.remember(rid)
        for dom, rec in heldout:
            self.heldout.setdefault(dom, deque(maxlen=self.cfg.heldout_per_domain)).append(rec)


__all__ = ["Intake", "SEEN_REQUESTS", "is_heldout", "refusal"]
