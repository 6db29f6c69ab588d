"""The near-line trainer: continually fine-tunes a copy of the champion head on captured traffic.

Owns: the loop as named steps — poll the store → route (fresh, or held out with evidence "heldout") →
test (evidence "prequential": the records of the next batch replayed by the champion and the snapshots
gathering evidence, trainer/prequential.py) → pack a batch (fresh rows + replayed earlier traffic) →
one `train_step` → checkpoint → ack → candidate (a snapshot that gathers evidence from then on; or,
held out, the acceptance replay of candidate and champion on the same held-out records), written to
the registry — plus resuming from its checkpoint after a crash, following a champion change, the
drift signal, and a status for the gateway and the demo. Must not touch: serving, promotion (the
policy decides what serves; the trainer only proposes).

Roles. `NearlineTrainer` is their composition: it runs the steps in order and keeps the loop, the faults and
the status; each role lives in a module of its own, which says what it owns and must not touch:
  trainer/ingest.py         Intake: deliveries, routing, the fresh queue, the replay buffer, held-out pools, acks owed
  trainer/prequential.py    EvidenceBook: the snapshots gathering test-then-train evidence
  trainer/learner.py        Learner: the head, its optimizer and the update (here, or on data-parallel workers)
  trainer/checkpointing.py  the resume state on disk
  trainer/candidates.py     CandidateWriter: the cadence, a candidate's evidence, latency and registration
  trainer/drift.py, trainer/moe.py: the drift monitor, MoE growth
The roles share the trainer's `counters` (one dict, checkpointed whole: reset in place, never rebound) and
its event log (`_note`).

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
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from adaptive_eagle.checkpoint import load_head
from adaptive_eagle.draft_head import Eagle3DraftHead
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle.targets import Target, load_target, resolve_device
from adaptive_eagle.trace import TraceRecord
from adaptive_eagle.versions import PLAIN
from feature_store.backend import StoreUnavailable
from feature_store.reader import StoreReader
from trainer.buffer import ReplayBuffer
from trainer.candidates import CandidateWriter, candidate_latency, describe_latency
from trainer.checkpointing import ResumeState, has_checkpoint, read_checkpoint, state_dir, write_checkpoint
from trainer.config import NearlineConfig
from trainer.drift import DriftMonitor
from trainer.ingest import Intake, is_heldout
from trainer.learner import Learner
from trainer.moe import MoEGrowth
from trainer.prequential import EvidenceBook
from trainer.replay import ReplayScore
from trainer.step import StepStats
from trainer.warm_start import head_from_traffic

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised by a step that `inject_step_fault` armed (rehearsals inject it; nothing else raises it)."""


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
    rows_replayed: int = 0  # replay rows trained (beside fresh ones, owed, or idle passes)
    evidence: str = "heldout"  # how candidates are judged (cfg.evidence)
    gathering: list = None  # prequential: the snapshots gathering evidence (version, records, greedy, path)
    evidence_rows: int = 0  # prequential: evidence rows written by this process

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def zero_counters() -> dict:
    """The trainer's counters at the start of training from a champion (checkpointed with the state)."""
    return {"records_seen": 0, "records_trained": 0, "tokens_trained": 0, "tokens_received": 0, "steps": 0,
            "duplicates": 0, "regenerated_rows": 0, "skipped": {}, "candidates": [], "window": None,
            "aged_to_replay": 0, "rows_replayed": 0}


class NearlineTrainer:
    def __init__(self, cfg: NearlineConfig, *, target: Target | None = None, reader: StoreReader | None = None,
                 yield_to: Callable[[], bool] | None = None,
                 worker_target: Callable[[], Target] | None = None) -> None:
        """yield_to: called before each step; True makes the trainer wait (e.g. requests are queued on a
        machine whose cores it shares with a server). worker_target: with cfg.workers > 1, a picklable
        builder of each data-parallel worker's target (None: the workers load the trainer's target by name)."""
        self.cfg = cfg
        self.registry = HeadRegistry(cfg.registry)
        self.target = target
        self.target_spec: str | None = None  # what start() loaded the target from (data-parallel workers load the same)
        self.yield_to = yield_to
        self.device = resolve_device(cfg.device)
        self.work_dir = Path(cfg.work_dir)
        self.events: deque[str] = deque(maxlen=200)  # drift and candidate lines, newest last
        self.counters = zero_counters()  # shared by the roles: reset in place (_reset_counters), never rebound
        self.drift = DriftMonitor(cfg.drift_alpha, cfg.drift_drop, cfg.drift_min_records, cfg.drift_sustain,
                                  cfg.drift_boost)
        self.moe = MoEGrowth(cfg.moe_max_experts, cfg.moe_grow_after_records) if cfg.moe_grow else None
        # evidence "prequential": the snapshots gathering test-then-train evidence
        self.book = EvidenceBook(cfg.registry, cfg.tree, max_pending=cfg.max_pending_candidates,
                                 max_records=cfg.candidate_evidence_records)
        self.intake = Intake(cfg, reader or StoreReader(cfg.store, cfg.group, cfg.consumer), self.counters,
                             self.drift, self.moe, self._note)
        self.learner = Learner(cfg, self.device, self.work_dir, worker_target, self._note)
        self.candidates = CandidateWriter(cfg, self.registry, self.book, self.counters, self._note)
        self.champion_head: Eagle3DraftHead | None = None
        self.base = PLAIN
        self.loss: float | None = None
        self.last_batch: dict = {}
        self._yield_since: float | None = None  # when the current stretch of yielding to requests began
        self.state = "starting"
        self.errors_total, self.last_error, self.last_step_at = 0, None, None
        self._step_fault: str | None = None  # inject_step_fault: the next step raises this
        self._store_errors = 0  # store errors in a row (the backoff's exponent)
        self._degraded_since: float | None = None  # unix seconds of the first of them
        self._last_checkpoint = self._last_champion_check = time.monotonic()

    # ---- the roles' state, by the names callers use ------------------------------------------------------
    @property
    def reader(self) -> StoreReader:
        return self.intake.reader

    @property
    def head(self) -> Eagle3DraftHead | None:
        return self.learner.head

    @property
    def opt(self) -> torch.optim.Optimizer | None:
        return self.learner.opt

    @property
    def fresh(self) -> deque[tuple[str, TraceRecord]]:
        return self.intake.fresh

    @property
    def heldout(self) -> dict[str, deque[TraceRecord]]:
        return self.intake.heldout

    @property
    def buffer(self) -> ReplayBuffer[bytes]:
        return self.intake.buffer

    @property
    def done_ids(self) -> list[str]:
        return self.intake.done_ids

    @property
    def seen_requests(self) -> deque[str]:
        return self.intake.seen_requests

    @property
    def prequential(self) -> bool:
        return self.cfg.evidence == "prequential"

    # ---- start, resume, follow the champion ---------------------------------------------------------
    def start(self) -> None:
        if self.target is None:
            self.target_spec = self.cfg.target or self._champion_target_name()
            self.target = load_target(self.target_spec, purpose="train")
        champion = self.registry.champion()
        if self.prequential and (n := self.book.close_orphans("the trainer restarted (the snapshot's evidence "
                                                               "stops here)")):
            self._note(f"closed the evidence of {n} earlier snapshots: the trainer restarted")
        if has_checkpoint(self.work_dir) and self._resume(champion):
            return
        self._reset_to(champion)

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

    def _reset_counters(self, values: dict) -> None:
        """Replace the counters' contents in place (the roles hold this dict)."""
        self.counters.clear()
        self.counters.update(values)

    def _reset_to(self, champion: str) -> None:
        """Start fine-tuning a fresh copy of `champion` (or the base head / a new head while it is 'none')."""
        self.base = champion
        self.book.close_all(f"the champion changed to {champion}")
        if champion != PLAIN:
            self.champion_head = self._load(champion).float().eval()
            self.learner.set_head(copy.deepcopy(self.champion_head).train())
        else:
            self.champion_head = None
            self.learner.set_head(self._load(self.cfg.base_head).float().train() if self.cfg.base_head else None)
        self._reset_counters({**zero_counters(), "records_seen": self.counters["records_seen"]})
        self.candidates.restart()  # what the old head trained on is not in the new one
        self.drift.reset(None if champion == PLAIN else champion)
        if self.moe is not None:  # the champion's domain -> expert map (head.json training.moe)
            self.moe.reset(self.registry.version(champion).training if champion != PLAIN else {})
        self._note(f"training from champion {champion}" + (" (base head " + self.cfg.base_head + ")"
                                                              if champion == PLAIN and self.cfg.base_head else ""))

    def follow_champion(self) -> bool:
        """Follow the registry's champion when it changed (a promotion, a rollback). True if it did. A snapshot of
        this trainer's own line (written since its last restart) keeps the line: the head goes on training from
        where it is, the snapshot plus every step since, instead of restarting from the snapshot and throwing
        those steps away; any other champion (a rollback, a head from elsewhere) restarts from it."""
        self._last_champion_check = time.monotonic()
        champion = self.registry.champion()
        if champion == self.base:
            return False
        if champion != PLAIN and champion in self.counters["candidates"] and self.learner.head is not None:
            self._keep_line(champion)
            return True
        self._note(f"champion changed {self.base} -> {champion}: restarting from it")
        self._reset_to(champion)
        return True

    def _keep_line(self, champion: str) -> None:
        """The champion is a snapshot of this line: judge against it from now on, keep training the line. The
        snapshots gathering evidence close (replayed against the old champion); the line's steps since its last
        snapshot are untested, so the next snapshot is due at once."""
        later = self.counters["candidates"][::-1].index(champion)
        self._note(f"champion changed {self.base} -> {champion}, a snapshot of this trainer's line: the line goes on "
                   f"from where it is (every step since {champion} kept; {later} later snapshot(s) of it were "
                   "judged against the old champion)")
        self.base = champion
        self.book.close_all(f"the champion changed to {champion}")
        self.champion_head = self._load(champion).float().eval()
        self.candidates.due_now()
        self.drift.reset(champion)

    # ---- poll and route --------------------------------------------------------------------------
    def poll(self, block_ms: int = 0) -> int:
        """Read what the store has; returns the number of new records taken."""
        return self.intake.poll(block_ms, self.target.fingerprint)

    # ---- one step ----------------------------------------------------------------------------------
    def ready(self) -> str | None:
        """What the next step would train on: "fresh", "owed" (replay alone: the replay share long fresh rows left no
        room for), "replay" (idle: more passes over the buffer), or None."""
        if self.head is None:
            return None
        return self.intake.ready()

    def train_once(self, force: bool = False) -> StepStats | None:
        """One optimizer step on fresh traffic plus replay rows, or on replay alone while idle. `force`
        trains on whatever fresh records there are."""
        if self.head is None:
            self._maybe_cold_start()
            if self.head is None:
                return None
        self._test(self.intake.age_out())
        kind = self.ready()
        if force and self.fresh and kind != "owed":
            kind = "fresh"
        if kind is None:
            return None
        fresh = self.intake.take_fresh() if kind == "fresh" else []
        self._test([r for _, r in fresh])
        if fresh:
            replayed = self.intake.replay_for([r for _, r in fresh])
        else:  # the replay share owed, or idle: another pass over earlier traffic
            replayed = self.intake.replay_batch()
        rows = self.learner.rows([r for _, r in fresh] + replayed)
        cut = {r.request_id for r in rows if not r.trained_positions}  # e.g. a prompt longer than max_len
        if untrainable := sum(1 for r in rows if not r.trained_positions):
            rows = [r for r in rows if r.trained_positions]
            reason = ("no_new_position_within_max_len" if self.cfg.positions == "new"  # carried by earlier records
                      else "no_trained_position_within_max_len")
            self.counters["skipped"][reason] = self.counters["skipped"].get(reason, 0) + untrainable
        if self._step_fault is not None:
            message, self._step_fault = self._step_fault, None
            raise InjectedFault(message)
        if not rows:  # every record of the batch cut before its first trained token: consumed, nothing learned,
            self.intake.consumed(fresh, cut, trained_at=time.time())  # no step and no replay row counted
            self.last_batch = {"fresh": len(fresh), "replay": 0, "tokens": 0, "regenerated": 0}
            return None
        self.state = "training"
        if self.moe is not None and (grown := self.moe.grow(self.head, self.target)) is not None:
            self.learner.set_head(grown.head.float().train())  # a new optimizer over the grown head's parameters
            self._note(grown.describe())
        stats, tokens, regenerated = self.learner.update(rows, self.counters["steps"], self.target, self.target_spec,
                                                         self.moe)
        self.counters["steps"] += 1
        self.last_step_at = time.time()
        self.counters["tokens_trained"] += tokens
        trained_replay = sum(1 for r in replayed if r.request_id not in cut)  # a cut replay row trained nothing
        # .get: a counter an older checkpoint lacks
        self.counters["rows_replayed"] = self.counters.get("rows_replayed", 0) + trained_replay
        self.counters["regenerated_rows"] += regenerated
        self.loss = stats.loss
        self.last_batch = {"fresh": len(fresh), "replay": trained_replay, "tokens": tokens, "regenerated": regenerated}
        times = self.intake.consumed(fresh, cut, trained_at=time.time())
        self.candidates.trained([r for _, r in fresh], times)
        return stats

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

    def sync_head(self) -> None:
        """Bring self.head (and the optimizer's moments) level with the workers' after data-parallel steps."""
        self.learner.sync()

    def _maybe_cold_start(self) -> None:
        """Champion 'none' and no base head: build a head from the traffic's own tokens."""
        records = self.intake.waiting_records()
        if len(records) < self.cfg.cold_start_records:
            return
        head, vocab = head_from_traffic(self.target, [r.input_ids for r in records], seed=self.cfg.seed)
        self.learner.set_head(head.float().train())
        self._note(f"cold start: new head with a {vocab.target_ids.numel()}-token draft vocabulary from "
                   f"{len(records)} records ({vocab.coverage:.1%} coverage)")

    # ---- checkpoint and ack ------------------------------------------------------------------------
    def checkpoint(self) -> None:
        """Write the state atomically, then ack every record it covers."""
        self.sync_head()
        if self.head is not None:
            write_checkpoint(self.work_dir, self.head, self.opt, self._resume_state(), self.cfg.store.codec)
        self.intake.ack_done()
        self._last_checkpoint = time.monotonic()

    def _resume_state(self) -> ResumeState:
        buffer = self.intake.buffer
        return ResumeState(
            base=self.base, counters=self.counters, tokens_at_candidate=self.candidates.tokens_at_candidate,
            seen_requests=list(self.intake.seen_requests), moe=self.moe.state() if self.moe is not None else None,
            buffer_seen=buffer.seen(), buffer_priorities=buffer.priorities(), replay=buffer.items(),
            heldout=[(dom, r) for dom, pool in self.intake.heldout.items() for r in pool])

    def _resume(self, champion: str) -> bool:
        """Restore the checkpoint if it was trained from the current champion; False otherwise."""
        try:
            saved = read_checkpoint(self.work_dir, self.target)
        except (OSError, ValueError, KeyError) as e:
            self._note(f"checkpoint in {state_dir(self.work_dir)} refused ({e}); starting from champion {champion}")
            return False
        if saved.base != champion:
            self._note(f"checkpoint was trained from {saved.base}, champion is {champion}: starting over")
            return False
        state = saved.resume_state()
        try:  # first, while nothing else is restored: a refusal leaves the trainer as it was
            self.intake.restore(state.seen_requests, state.replay, state.buffer_seen, state.buffer_priorities,
                                state.heldout)
        except ValueError as e:  # refused, not a crash loop: Ray would restart the actor into the same error
            self._note(f"checkpoint in {state_dir(self.work_dir)} refused ({e}); starting from champion {champion}")
            return False
        self._reset_to(champion)
        self.learner.set_head(saved.head.float().train())
        saved.restore_optimizer(self.opt)
        self._reset_counters(state.counters)
        self.candidates.tokens_at_candidate = state.tokens_at_candidate
        if self.moe is not None:
            self.moe.restore(state.moe)
        self._note(f"resumed from checkpoint: step {self.counters['steps']}, "
                   f"{self.counters['tokens_trained']} tokens trained")
        return True

    # ---- candidates --------------------------------------------------------------------------------
    def candidate_due(self) -> bool:
        return self.candidates.due(self.head is not None, self.intake.heldout_count())

    def heldout_records(self) -> list[TraceRecord]:
        return self.intake.heldout_records()

    def evaluate(self, head: Eagle3DraftHead) -> tuple[ReplayScore, ReplayScore | None, dict]:
        """Replay `head` and the champion on the same held-out records."""
        return self.candidates.evaluate(head, self.champion_head, self.heldout_records(), self.target)

    def write_candidate(self) -> str | None:
        """Save the current head as a candidate version. Evidence "heldout": with its replay scores next to the
        champion's on the held-out records. "prequential": as a snapshot that gathers its evidence from the
        records read from now on (and those still waiting for a step), which the policy re-reads."""
        self.state = "evaluating"
        self.sync_head()
        return self.candidates.write(self.head, base=self.base, champion_head=self.champion_head,
                                     heldout=self.heldout_records(), target=self.target, moe=self.moe)

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
            candidate_latency=self.candidates.last_latency, aged_to_replay=c.get("aged_to_replay", 0),
            rows_replayed=c.get("rows_replayed", 0),
            evidence=self.cfg.evidence, gathering=self.book.status(), evidence_rows=self.book.rows_written)

    def close(self) -> None:
        self.learner.close()
        self.reader.close()


__all__ = ["InjectedFault", "NearlineTrainer", "TrainerStatus", "candidate_latency", "describe_latency", "is_heldout"]
