"""Replicas as the gateway sees them, and the router that leases them to requests.

Owns: the async `Replica` interface over an in-process `DecodeServer` (`LocalReplica`) or a Ray
`ServerActor` (`RayReplica`); the `Router`: up to each replica's capacity in flight at once (its
`max_inflight`: 1 for the reference engine, what SGLang batches for an SGLang replica), each request to
the eligible replica with the least load (in flight / capacity), a bounded wait
queue with back-pressure (`QueueFull` -> 429), the head each replica serves, and canary routing (a
fraction of requests to the replicas serving the candidate, or a per-request head override), and a
lease that avoids one replica (the gateway's one retry of a request whose replica failed before it
produced anything). The canary is the policy's (`policies.canary.Canary`: the record, and the rule that
a request's number below the share goes to the candidate); the router draws that number at random per
request. Must not touch: HTTP (gateway.py), decoding (server.py), swap policy (fleet.py decides what to
swap).
"""

from __future__ import annotations

import asyncio
import random
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Optional, Protocol

from adaptive_eagle.binding import SwapResult
from adaptive_eagle.versions import version_label
from policies.canary import Canary
from serving.messages import DecodeRequest, Event, ServerStatus
from serving.server import DecodeServer


class Replica(Protocol):
    name: str
    max_inflight: int  # requests it decodes at once

    def stream(self, request: DecodeRequest) -> AsyncIterator[Event]: ...

    async def swap_head(self, version: str) -> SwapResult: ...

    async def set_canary(self, version: Optional[str], fraction: float) -> SwapResult: ...

    async def status(self) -> ServerStatus: ...


class LocalReplica:
    """A DecodeServer in the gateway's process (its decode threads keep the event loop free)."""

    def __init__(self, server: DecodeServer) -> None:
        self.server, self.name = server, server.name

    @property
    def max_inflight(self) -> int:
        return self.server.max_inflight

    def stream(self, request: DecodeRequest) -> AsyncIterator[Event]:
        return self.server.astream(request)

    async def swap_head(self, version: str) -> SwapResult:
        return await asyncio.to_thread(self.server.swap_head, version)

    async def set_canary(self, version: Optional[str], fraction: float) -> SwapResult:
        return await asyncio.to_thread(self.server.set_canary, version, fraction)

    async def status(self) -> ServerStatus:
        return await asyncio.to_thread(self.server.status)


class RayReplica:
    """A ServerActor handle; events come back through a Ray streaming generator. `max_inflight`: what the
    actor's server decodes at once (serving.replicas.replica_capacity of its config); an async actor runs up
    to 1000 calls at once (Ray's default max_concurrency for async actors), so the streams reach it."""

    def __init__(self, handle, name: str, max_inflight: int = 1) -> None:
        self.handle, self.name, self.max_inflight = handle, name, max_inflight

    async def stream(self, request: DecodeRequest) -> AsyncIterator[Event]:
        refs = self.handle.stream.options(num_returns="streaming").remote(request)
        async for ref in refs:
            yield await ref

    async def swap_head(self, version: str) -> SwapResult:
        return await self.handle.swap_head.remote(version)

    async def set_canary(self, version: Optional[str], fraction: float) -> SwapResult:
        return await self.handle.set_canary.remote(version, fraction)

    async def status(self) -> ServerStatus:
        return await self.handle.status.remote()


SUSPECT_MAX_S = 30.0  # the longest a failed replica is routed to last before it is tried like the others again


class QueueFull(Exception):
    """Every eligible replica is full and the wait queue is full (or the wait timed out)."""


class NoReplica(Exception):
    """No replica serves the head version a request asked for."""


@dataclass
class Slot:
    replica: Replica
    version: str  # the head it serves ("none": plain decoding)
    capacity: int = 1  # requests it takes at once (the replica's max_inflight)
    inflight: int = 0  # requests leased to it now
    held: bool = False  # drained for a swap: nothing new is routed to it
    failures: int = 0  # consecutive failures (a request it failed, a status it did not answer)
    suspect_until: float = 0.0  # loop time until which it is passed over while a healthy replica may serve

    @property
    def open(self) -> bool:
        """Can take one more request now."""
        return not self.held and self.inflight < self.capacity

    @property
    def load(self) -> float:
        return self.inflight / self.capacity


class Router:
    def __init__(self, replicas: list[Replica], versions: list[str], queue_size: int, wait_timeout_s: float,
                 rng: Optional[random.Random] = None) -> None:
        if len(replicas) != len(versions) or not replicas:
            raise ValueError("one version per replica, and at least one replica")
        self.slots = [Slot(r, v, capacity=max(1, int(getattr(r, "max_inflight", 1)))) for r, v in zip(replicas, versions)]
        self.queue_size, self.wait_timeout_s = queue_size, wait_timeout_s
        self.canary: Optional[Canary] = None  # the policy's canary, routed to the replicas serving it
        self.waiting = 0
        self._rng = rng or random.Random()
        self._cond = asyncio.Condition()

    # ---- views --------------------------------------------------------------------------------
    def serving_versions(self) -> list[str]:
        return sorted({s.version for s in self.slots})

    @property
    def busy(self) -> int:
        """Replicas with at least one request in flight."""
        return sum(s.inflight > 0 for s in self.slots)

    @property
    def inflight(self) -> int:
        """Requests in flight on all replicas."""
        return sum(s.inflight for s in self.slots)

    @property
    def capacity(self) -> int:
        return sum(s.capacity for s in self.slots)

    def set_version(self, replica: Replica, version: Optional[str]) -> None:
        for s in self.slots:
            if s.replica is replica:
                s.version = version_label(version)

    # ---- leasing --------------------------------------------------------------------------------
    def _pool(self, head: Optional[str]):
        """Which replicas may serve this request (a predicate over slots)."""
        canary = self.canary
        if head is not None:
            if canary is not None and head == canary.version and head not in self.serving_versions():
                return lambda s: True  # a canary inside the replicas: any replica decodes with it
            if head not in self.serving_versions():
                raise NoReplica(f"no replica serves head {head!r}; serving: {', '.join(self.serving_versions())}")
            return lambda s: s.version == head
        # the canary draw is fixed per request, but eligibility is re-read against the live canary each
        # time a waiting request wakes: a promotion or an ended canary while it waits must not strand it
        draw = self._rng.random()  # drawn with or without a canary (a seeded router's draws stay in step)
        to_canary = canary is not None and canary.takes_draw(draw)

        def eligible(s: Slot) -> bool:
            live = self.canary
            if live is None or live.version not in self.serving_versions():
                return True
            return (s.version == live.version) == to_canary

        return eligible

    async def fleet_changed(self) -> None:
        """Wake every waiting request to re-check which replicas may serve it (after a swap or a canary change)."""
        async with self._cond:
            self._cond.notify_all()

    def _free(self, eligible) -> Optional[Slot]:
        """The eligible replica with room and the least load (in flight / capacity; the first of equals). A
        suspect replica (one that just failed: its node may be gone, and idle it would have the least load and
        take every new request) is used only while no healthy replica may serve the request: the request waits
        for a healthy one's free slot instead (outlier ejection), and with none left it tries the suspects."""
        now = asyncio.get_running_loop().time()
        pool = [s for s in self.slots if eligible(s)]
        healthy = [s for s in pool if s.suspect_until <= now]
        return min((s for s in healthy or pool if s.open), key=lambda s: s.load, default=None)

    # ---- health ---------------------------------------------------------------------------------
    def replica_failed(self, replica: Replica) -> None:
        """`replica` failed a request or a status call: passed over while a healthy replica may serve, for a
        cool-down that doubles with each failure in a row (1 s, 2 s, ... SUSPECT_MAX_S), until it serves or
        answers again. With no healthy replica left it is still tried (a fast 503 beats waiting for nothing)."""
        now = asyncio.get_running_loop().time()
        for s in self.slots:
            if s.replica is replica:
                s.failures += 1
                s.suspect_until = now + min(SUSPECT_MAX_S, 2.0 ** (s.failures - 1))

    def replica_ok(self, replica: Replica) -> bool:
        """`replica` served a request or answered its status: healthy again. True when it was a suspect (then
        the caller wakes the waiting requests: `fleet_changed`)."""
        now, was = asyncio.get_running_loop().time(), False
        for s in self.slots:
            if s.replica is replica:
                was = was or s.suspect_until > now
                s.failures, s.suspect_until = 0, 0.0
        return was

    def suspects(self) -> list[str]:
        """The replicas passed over now."""
        now = asyncio.get_running_loop().time()
        return [s.replica.name for s in self.slots if s.suspect_until > now]

    def _avoiding(self, eligible, avoid: Replica):
        """`eligible` without `avoid`; NoReplica when no other slot may serve the request (waiting for a slot
        that can never come would only turn the failure into a timeout)."""
        def others(s: Slot) -> bool:
            return s.replica is not avoid and eligible(s)

        if not any(map(others, self.slots)):
            raise NoReplica(f"no replica other than {avoid.name} may serve this request")
        return others

    @asynccontextmanager
    async def hold(self, slot: Slot) -> AsyncIterator[Slot]:
        """Drain `slot` and keep it: route it nothing more from now on, wait for its requests in flight (no
        deadline: a swap waits as long as they take), release it afterwards. The others serve meanwhile."""
        async with self._cond:
            await self._cond.wait_for(lambda: not slot.held)  # one hold at a time
            slot.held = True
        try:
            async with self._cond:
                await self._cond.wait_for(lambda: slot.inflight == 0)
            yield slot
        finally:
            async with self._cond:
                slot.held = False
                self._cond.notify_all()

    @asynccontextmanager
    async def _leased(self, slot: Slot) -> AsyncIterator[Slot]:
        """One request on `slot` (counted in its inflight): yield it, then release it and wake the waiters."""
        try:
            yield slot
        finally:
            async with self._cond:
                slot.inflight -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def lease(self, head: Optional[str] = None, avoid: Optional[Replica] = None) -> AsyncIterator[Slot]:
        """The least-loaded eligible replica with room for one request (waiting in the bounded queue if none has
        room); never `avoid`."""
        eligible = self._pool(head)
        if avoid is not None:
            eligible = self._avoiding(eligible, avoid)
        async with self._cond:
            slot = self._free(eligible)
            if slot is None:
                if self.waiting >= self.queue_size:
                    raise QueueFull(f"all {sum(map(eligible, self.slots))} eligible replicas are full and "
                                    f"{self.waiting} requests already wait (queue_size {self.queue_size}); retry later")
                deadline = asyncio.get_running_loop().time() + self.wait_timeout_s
                self.waiting += 1
                try:
                    # a fleet change can land between the wake (a slot was free and eligible) and this task
                    # resuming, so the slot is looked up again and the wait repeats until one is really free
                    while slot is None:
                        left = deadline - asyncio.get_running_loop().time()
                        try:
                            if left <= 0:
                                raise asyncio.TimeoutError
                            await asyncio.wait_for(self._cond.wait_for(lambda: self._free(eligible) is not None),
                                                   left)
                        except asyncio.TimeoutError:
                            raise QueueFull(f"no replica became free within {self.wait_timeout_s:g} s; "
                                            "retry later") from None
                        slot = self._free(eligible)
                finally:
                    self.waiting -= 1
            slot.inflight += 1
        async with self._leased(slot):
            yield slot
