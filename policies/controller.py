"""PolicyController: the promotion state machine. A candidate head goes offline gate -> canary -> promote
(fleet hot swap, then the registry's champion pointer) -> watching -> watch ended, or is rejected; a
watched champion that collapses is rolled back and blocked. Every decision is a promotions.jsonl line.

Owns: the order of the steps and the states (idle, offline_gate, canary, watching). Must not touch:
torch, the trainer, the servers' internals, the statistics (``policies.gates``). It talks to the registry
through the small ``Registry`` protocol below (``adaptive_eagle.registry.HeadRegistry`` satisfies it;
importing it here would import torch) and to the servers through ``policies.fleet.Fleet``.

Invariants:
- outside a canary the fleet serves one version; a swap that some replica refuses is swapped back;
- the champion pointer moves (compare-and-set, ``expect=`` the old champion) only after every replica
  confirmed the new version;
- a pinned registry promotes nothing (candidates are held; a running canary ends); blocked versions are
  never considered, and the fleet is never swapped onto one (even when the registry's pointer names it);
- champion "none" (plain decoding): the canary is judged by ``cold_start_gate`` (wall time per token).

On-call operations (``rollback``, ``pin``, ``unpin``) are also module functions over a registry and a log
alone (the CLI has no fleet); the controller then brings the fleet to the registry's champion on its next
idle ``tick()``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Protocol, Sequence

from adaptive_eagle.versions import PLAIN

from policies.config import PolicyConfig
from policies.fleet import Fleet
from policies.gates import (
    CONTINUE, HOLD, PROMOTE, REJECT, ROLLBACK, Decision, canary_gate, cold_start_gate, domains_line, health_canary_gate,
    offline_gate, sequential_offline_gate,
    rollback_check,
)
from policies.log import PromotionLog
from policies.samples import RequestSample

log = logging.getLogger(__name__)
State = Literal["idle", "offline_gate", "canary", "watching"]



def stale_evidence(replay_champion: Sequence[RequestSample], champion: str) -> str | None:
    """Why replay evidence cannot be judged against `champion` (it was measured against another head), or None.
    A gate never compares a candidate with a champion it was not replayed against: after a promotion, a
    candidate replayed against the old champion is rejected, and the trainer's next one is replayed against
    the new champion."""
    against = {s.head_version for s in replay_champion}
    if not against or against == {champion}:
        return None
    return (f"stale evidence: the candidate was replayed against {', '.join(sorted(against))}, but the champion is "
            f"now {champion}; a gate never judges a comparison with another champion (the next candidate is "
            f"replayed against {champion})")

class Registry(Protocol):
    """What the controller needs of ``adaptive_eagle.registry.HeadRegistry``."""

    def __contains__(self, version: object) -> bool: ...
    def champion(self) -> str: ...
    def champion_pointer(self): ...  # .version, .previous
    def set_champion(self, version: str, *, expect: str, reason: str = ""): ...  # -> .ok, .message
    def pinned(self): ...  # None or .version, .reason
    def pin(self, version: str, reason: str = ""): ...
    def unpin(self): ...
    def blocked(self) -> Mapping[str, object]: ...  # version -> .reason
    def block(self, version: str, reason: str): ...


@dataclass(frozen=True)
class CanaryRun:
    candidate: str
    champion: str
    since: float  # unix seconds: live samples from here on count
    mode: str = "evidence"  # "health" (exact replay proved the gain), "evidence" or "cold_start"
    domains: tuple = ()  # the offline gate's per-domain rows (gates.DomainRow as dicts): named when it is promoted


def canary_mode(config: PolicyConfig, champion: str, exact_replay: bool) -> str:
    """Which canary a candidate that passed the offline gate gets: "cold_start" against plain decoding (wall
    time per token), else config.canary_mode, where "auto" is "health" when its replay was exact (greedy
    records only) and "evidence" otherwise."""
    if champion == PLAIN:
        return "cold_start"
    if config.canary_mode != "auto":
        return config.canary_mode
    return "health" if exact_replay else "evidence"


CANARY_GATES = {"health": health_canary_gate, "evidence": canary_gate, "cold_start": cold_start_gate}
CANARY_NAMES = {"health": "health canary (exact replay proved the gain; live checks collapse, acceptance and "
                          "latency harm)",
                "evidence": "evidence canary (replay was not exact: the live tail carries the evidence)",
                "cold_start": "cold-start canary (TPOT against plain decoding)"}


@dataclass(frozen=True)
class Watch:
    version: str  # the new champion
    previous: str  # the champion it replaced
    since: float
    baseline: tuple[RequestSample, ...]  # the previous champion's last rollback_window live requests


# ---- on-call operations: registry + log (the CLI's, and the controller's) -------------------------------
def rollback_champion(registry: Registry, plog: PromotionLog, reason: str, *, by: str = "on-call",
                      version: str | None = None, previous: str | None = None, evidence: dict | None = None
                      ) -> Decision:
    """Move the champion pointer from `version` (default: the champion) back to `previous` (default: the
    pointer's previous), block `version` with `reason`, log rolled_back. Refusals raise ValueError."""
    pointer = registry.champion_pointer()
    version = version or pointer.version
    previous = previous if previous is not None else pointer.previous
    if version == PLAIN:
        raise ValueError("the champion is 'none' (plain decoding): nothing to roll back")
    if previous is None:
        raise ValueError(f"{version!r} has no previous champion to roll back to (heads champion --set moves it)")
    reason = reason or f"rolled back by {by}"
    change = registry.set_champion(previous, expect=version, reason=f"rollback: {reason}")
    if not change.ok:
        raise ValueError(f"cannot roll back {version!r} to {previous!r}: {change.message}")
    registry.block(version, reason)
    plog.record("rolled_back", candidate=version, champion=previous, action=ROLLBACK, by=by, evidence=evidence or {},
                reason=f"{version} rolled back to {previous} and blocked: {reason}")
    return Decision(ROLLBACK, reason, evidence or {})


def pin_version(registry: Registry, plog: PromotionLog, version: str, reason: str = "", *, by: str = "on-call"
                ) -> Decision:
    """Pin `version` and make it the champion if it is not; nothing else is promoted until unpinned."""
    champion = registry.champion()
    registry.pin(version, reason)
    if champion != version:
        change = registry.set_champion(version, expect=champion, reason=f"pinned: {reason}".rstrip(": "))
        if not change.ok:
            registry.unpin()
            raise ValueError(f"cannot make {version!r} the champion: {change.message}")
    why = f"{version} pinned{': ' + reason if reason else ''}; no promotion until unpinned"
    plog.record("pinned", candidate=version, champion=champion, action=HOLD, by=by, reason=why)
    return Decision(HOLD, why)


def unpin_version(registry: Registry, plog: PromotionLog, *, by: str = "on-call") -> Decision:
    """Remove the pin (logged only when something was pinned)."""
    removed = registry.unpin()
    if removed is None:
        return Decision(HOLD, "nothing was pinned")
    why = f"{removed.version} unpinned; promotions resume"
    plog.record("unpinned", candidate=removed.version, champion=registry.champion(), action=HOLD, by=by, reason=why)
    return Decision(HOLD, why)


def plain_replay(samples: Sequence[RequestSample]) -> list[RequestSample]:
    """Plain decoding's replay of the same records: exactly one token per step (accept length 1.0)."""
    return [RequestSample(accept_length=1.0, head_version=PLAIN, domain=s.domain, request_id=s.request_id,
                          tokens=s.tokens, context=s.context) for s in samples]


# ---- the state machine --------------------------------------------------------------------------------
class PolicyController:
    """Drive with ``consider`` (a candidate from the trainer) and ``tick`` (every few seconds)."""

    def __init__(self, registry: Registry, fleet: Fleet, plog: PromotionLog, config: PolicyConfig | None = None,
                 *, clock: Callable[[], float] = time.time) -> None:
        self.registry, self.fleet, self.plog = registry, fleet, plog
        self.config = config or PolicyConfig()
        self.clock = clock
        self._state: State = "idle"
        self._canary: CanaryRun | None = None
        self._watch: Watch | None = None
        self._lock = threading.RLock()
        self._gathering: set[str] = set()  # candidates whose growing evidence was looked at and not decided yet

    @property
    def state(self) -> State:
        return self._state

    def status(self) -> dict:
        with self._lock:
            run, watch = self._canary, self._watch
            return {"state": self._state, "champion": self.registry.champion(),
                    "canary": None if run is None else {"candidate": run.candidate, "since": run.since, "mode": run.mode},
                    "watching": None if watch is None else {"version": watch.version, "previous": watch.previous,
                                                            "since": watch.since},
                    "serving": self.fleet.serving_versions(), "gathering": sorted(self._gathering)}

    def _to(self, state: State, why: str) -> None:
        log.info("policy: %s -> %s (%s)", self._state, state, why)
        self._state = state
        if state != "canary":
            self._canary = None
        if state != "watching":
            self._watch = None

    # ---- a candidate arrives -----------------------------------------------------------------------
    def consider(self, candidate: str, replay_champion: Sequence[RequestSample],
                 replay_candidate: Sequence[RequestSample], *, exact_replay: bool = False,
                 sequential: bool = False, final: bool = False) -> Decision:
        """Offline gate on acceptance replay (both heads on the same records); a pass starts the canary.
        exact_replay: every replayed record was greedy, so the replay is what the head would have served and
        the canary only checks live health (`canary_mode`). sequential: the evidence grows (test-then-train)
        and is judged by the sequential offline gate each time it is given again; `final` when it stopped
        growing. An undecided look is not logged (the first look logs `considered`, the decision its line)."""
        with self._lock:
            champion = self.registry.champion()
            refusal = self._refusal(candidate, champion)
            first_look = not sequential or candidate not in self._gathering
            if first_look or refusal is not None:
                how = (f"sequential offline gate on test-then-train evidence ({len(replay_candidate)} paired records "
                       "so far)" if sequential else f"offline gate on {len(replay_candidate)} replayed records")
                self.plog.record("considered", candidate=candidate, champion=champion,
                                 action=None if refusal is None else refusal.action,
                                 reason=refusal.reason if refusal else how)
            if refusal is not None:
                self._gathering.discard(candidate)
                return refusal
            stale = stale_evidence(replay_champion, champion)
            if stale is not None:
                self._gathering.discard(candidate)
                self.plog.record("rejected", candidate=candidate, champion=champion, action=REJECT, reason=stale)
                return Decision(REJECT, stale)
            if champion == PLAIN and not replay_champion:
                replay_champion = plain_replay(replay_candidate)
            if sequential:
                decision = sequential_offline_gate(replay_champion, replay_candidate, self.config, final=final)
                if decision.action == CONTINUE:
                    self._gathering.add(candidate)
                    return decision
                self._gathering.discard(candidate)
            else:
                self._to("offline_gate", f"considering {candidate}")
                decision = offline_gate(replay_champion, replay_candidate, self.config)
            if decision.action != PROMOTE:
                what = "offline gate needs more data" if decision.action == CONTINUE else "offline gate"
                self.plog.record("rejected", candidate=candidate, champion=champion, action=decision.action,
                                 reason=f"{what}: {decision.reason}", evidence=decision.evidence)
                self._to("idle", f"{candidate} not promoted offline")
                return decision
            try:
                self.fleet.set_canary(candidate, self.config.canary_fraction)
            except Exception as e:  # noqa: BLE001 - any fleet refusal (too few replicas, a refused head) ends here
                reason = f"the canary could not start: {e}"
                self.plog.record("rejected", candidate=candidate, champion=champion, action=REJECT, reason=reason,
                                 evidence=decision.evidence)
                self._to("idle", "canary refused by the fleet")
                return Decision(REJECT, reason, decision.evidence)
            self._to("canary", f"{candidate} passed the offline gate")
            mode = canary_mode(self.config, champion, exact_replay)
            self._canary = CanaryRun(candidate=candidate, champion=champion, since=self.clock(), mode=mode,
                                     domains=tuple(decision.evidence.get("domains") or ()))
            self.plog.record("canary_started", candidate=candidate, champion=champion, action=PROMOTE,
                             evidence={**decision.evidence, "canary": mode, "exact_replay": exact_replay},
                             reason=f"offline gate passed, {CANARY_NAMES[mode]} on "
                                    f"{self.config.canary_fraction:.0%} of requests: {decision.reason}")
            return decision

    def _refusal(self, candidate: str, champion: str) -> Decision | None:
        if self._state != "idle":
            busy = self._canary.candidate if self._canary else self._watch.version if self._watch else "?"
            return Decision(HOLD, f"busy: {self._state} of {busy}; consider {candidate} later.")
        if candidate == PLAIN or candidate not in self.registry:
            return Decision(REJECT, f"{candidate!r} is not a head version of the registry.")
        blocked = self.registry.blocked()
        if candidate in blocked:
            return Decision(REJECT, f"{candidate} is blocked: {getattr(blocked[candidate], 'reason', '')}")
        if (pin := self.registry.pinned()) is not None:
            return Decision(HOLD, f"{pin.version} is pinned; no promotion until unpinned.")
        if candidate == champion:
            return Decision(HOLD, f"{candidate} already is the champion.")
        if (why := self.fleet.cannot_serve(candidate)) is not None:
            return Decision(REJECT, f"{candidate} cannot serve on this fleet: {why}.")
        return None

    # ---- the periodic step -------------------------------------------------------------------------
    def tick(self) -> Decision | None:
        """Canary: judge live samples. Watching: the rollback check. Idle: bring the fleet to the registry's
        champion (after an on-call rollback or pin). Returns the decision taken, None when idle and in sync."""
        with self._lock:
            if self._state == "canary":
                return self._tick_canary()
            if self._state == "watching":
                return self._tick_watch()
            return self._reconcile()

    def _tick_canary(self) -> Decision:
        run = self._canary
        champion, pin = self.registry.champion(), self.registry.pinned()
        if pin is not None or champion != run.champion:
            why = f"{pin.version} was pinned" if pin is not None else f"the champion moved to {champion}"
            return self._end_canary(run, Decision(HOLD, f"canary of {run.candidate} ended: {why}."))
        champ = self.fleet.live_samples(run.champion, run.since)
        cand = self.fleet.live_samples(run.candidate, run.since)
        decision = CANARY_GATES[run.mode](champ, cand, self.config)
        if decision.action == CONTINUE:
            return decision
        self._end_canary(run, decision)
        if decision.action != PROMOTE:
            return decision
        # the watch compares the new champion with the previous one's last rollback_window live requests (not only
        # its canary share: a health canary of a few requests is no baseline for a tail)
        recent = sorted(self.fleet.live_samples(run.champion, 0.0), key=lambda s: s.finished_at)
        return self._promote(run, decision, baseline=recent[-self.config.rollback_window:])

    def _end_canary(self, run: CanaryRun, decision: Decision) -> Decision:
        note = ""
        try:
            self.fleet.set_canary(None, 0.0)
        except Exception as e:  # noqa: BLE001 - logged; an idle tick brings the fleet to the champion
            log.warning("policy: ending the canary of %s failed: %s", run.candidate, e)
            note = f" (ending the canary failed: {e})"
        self.plog.record("canary_ended", candidate=run.candidate, champion=run.champion, action=decision.action,
                         reason=decision.reason + note, evidence=decision.evidence)
        if decision.action == REJECT:
            self.plog.record("rejected", candidate=run.candidate, champion=run.champion, action=REJECT,
                             reason=f"canary: {decision.reason}", evidence=decision.evidence)
        if decision.action != PROMOTE:
            self._to("idle", f"canary of {run.candidate} ended ({decision.action})")
        return decision

    def _promote(self, run: CanaryRun, decision: Decision, baseline: Sequence[RequestSample]) -> Decision:
        ok, why = self._swap_all(run.candidate, fallback=run.champion)
        if ok:
            change = self.registry.set_champion(run.candidate, expect=run.champion, reason=decision.reason)
            if not change.ok:
                back, back_why = self._swap_all(run.champion, fallback=None)
                ok, why = False, f"the registry refused: {change.message}" + ("" if back else f"; {back_why}")
        if not ok:
            reason = f"promotion of {run.candidate} failed, fleet back on {run.champion}: {why}"
            self.plog.record("rejected", candidate=run.candidate, champion=run.champion, action=REJECT,
                             reason=reason, evidence=decision.evidence)
            self._to("idle", "promotion failed")
            return Decision(REJECT, reason, decision.evidence)
        by_domain = domains_line(run.domains)  # what the offline evidence says per domain (on-call reads this)
        self.plog.record("promoted", candidate=run.candidate, champion=run.champion, action=PROMOTE,
                         reason=f"every replica serves {run.candidate}: {decision.reason}"
                                + (f" Offline, {by_domain}." if by_domain else ""),
                         evidence={**decision.evidence, "offline_domains": list(run.domains)})
        self._to("watching", f"{run.candidate} promoted")
        self._watch = Watch(version=run.candidate, previous=run.champion, since=self.clock(), baseline=tuple(baseline))
        return decision

    def _tick_watch(self) -> Decision:
        watch = self._watch
        champion, pin = self.registry.champion(), self.registry.pinned()
        if champion != watch.version or pin is not None:
            why = f"{pin.version} was pinned" if pin is not None else f"the champion moved to {champion}"
            decision = Decision(HOLD, f"watch of {watch.version} ended: {why}.")
            self.plog.record("watch_ended", candidate=watch.version, champion=watch.previous, action=HOLD,
                             reason=decision.reason)
            self._to("idle", "pinned, or the champion moved outside the policy")
            return decision
        decision = rollback_check(watch.baseline, self.fleet.live_samples(watch.version, watch.since), self.config)
        if decision.action == CONTINUE:
            return decision
        if decision.action == ROLLBACK:
            return self._roll_back(watch.version, watch.previous, decision.reason, decision.evidence, by="policy")
        self.plog.record("watch_ended", candidate=watch.version, champion=watch.previous, action=HOLD,
                         reason=decision.reason, evidence=decision.evidence)
        self._to("idle", "watch passed")
        return decision

    # ---- swaps -------------------------------------------------------------------------------------
    def _swap_all(self, version: str, fallback: str | None) -> tuple[bool, str]:
        """Swap every replica to `version`; True when every one confirmed it. Otherwise swap them all back
        to `fallback` (None: leave them) and say what went wrong."""
        results = self.fleet.swap(version)
        served = self.fleet.serving_versions()
        if all(r.ok for r in results) and all(v == version for v in served):
            return True, ""
        why = "; ".join(f"replica {i}: {r.message}" for i, r in enumerate(results) if not r.ok) \
            or f"replicas confirm {served}"
        if fallback is not None:
            self.fleet.swap(fallback)
            after = self.fleet.serving_versions()
            if any(v != fallback for v in after):
                why += f"; swap back to {fallback} incomplete, replicas serve {after}"
        return False, why

    def _roll_back(self, version: str, previous: str, reason: str, evidence: dict, *, by: str) -> Decision:
        ok, why = self._swap_all(previous, fallback=None)  # never back onto the head being rolled back
        if not ok:
            ok, why = self._swap_all(previous, fallback=None)  # one retry; idle ticks keep reconciling
        note = "" if ok else f" (fleet swap incomplete: {why})"
        try:
            decision = rollback_champion(self.registry, self.plog, reason + note, by=by, version=version,
                                         previous=previous, evidence=evidence)
        except ValueError as e:  # the pointer cannot move (e.g. previous blocked): block the bad head anyway
            try:
                self.registry.block(version, reason)
            except ValueError:
                pass
            why = (f"fleet rolled back from {version} to {previous}, but the registry refused: {e}; move the "
                   "champion pointer by hand (adaptive-eagle heads champion --set)")
            self.plog.record("rolled_back", candidate=version, champion=previous, action=ROLLBACK, by=by,
                             evidence=evidence, reason=f"{why}: {reason}")
            decision = Decision(ROLLBACK, why, evidence)
        self._to("idle", f"{version} rolled back")
        return decision

    def _reconcile(self) -> Decision | None:
        champion, served = self.registry.champion(), self.fleet.serving_versions()
        if all(v == champion for v in served):
            return None
        if champion in self.registry.blocked():  # never swap the fleet onto a blocked head
            return Decision(HOLD, f"the champion {champion} is blocked; the fleet stays on {served} until the "
                                  "pointer moves.")
        fallback = served[0] if len(set(served)) == 1 else None
        ok, why = self._swap_all(champion, fallback=fallback)
        if ok:
            log.info("policy: fleet brought to the champion %s (was %s)", champion, served)
            return Decision(HOLD, f"fleet now serves the champion {champion} (was {served}).")
        log.warning("policy: cannot bring the fleet to the champion %s: %s", champion, why)
        return Decision(HOLD, f"fleet does not serve the champion {champion}: {why}.")

    # ---- on-call -----------------------------------------------------------------------------------
    def rollback(self, reason: str = "", *, by: str = "on-call") -> Decision:
        """Abort a running canary (blocking its candidate), or roll the champion back to the previous one:
        fleet first, then the registry pointer; the version is blocked."""
        with self._lock:
            reason = reason or f"rolled back by {by}"
            if self._state == "canary":
                run = self._canary
                self._end_canary(run, Decision(HOLD, f"canary of {run.candidate} aborted: {reason}."))
                self.registry.block(run.candidate, reason)
                self.plog.record("rolled_back", candidate=run.candidate, champion=run.champion, action=ROLLBACK,
                                 by=by, reason=f"canary of {run.candidate} aborted and blocked: {reason}")
                return Decision(ROLLBACK, reason)
            pointer = self.registry.champion_pointer()
            previous = self._watch.previous if self._watch else pointer.previous
            if pointer.version == PLAIN or previous is None:
                raise ValueError(f"nothing to roll back: champion {pointer.version!r}, previous {previous!r}")
            return self._roll_back(pointer.version, previous, reason, {}, by=by)

    def pin(self, version: str, reason: str = "", *, by: str = "on-call") -> Decision:
        with self._lock:
            if self._state == "canary":
                self._end_canary(self._canary, Decision(HOLD, f"canary ended: {version} pinned."))
            decision = pin_version(self.registry, self.plog, version, reason, by=by)
            if self._state == "watching" and self._watch.version != version:
                self._to("idle", f"{version} pinned")
            self._reconcile()
            return decision

    def unpin(self, *, by: str = "on-call") -> Decision:
        with self._lock:
            return unpin_version(self.registry, self.plog, by=by)


__all__ = ["CanaryRun", "PolicyController", "Registry", "State", "Watch", "pin_version", "plain_replay",
           "rollback_champion", "unpin_version"]
