"""GatewayFleet: the gateway's replicas as the policy sees them (the `Fleet` of policies/fleet.py).

Owns: swapping every replica (all or nothing: replicas that took a version another one refused are
swapped back; SGLang replicas one at a time, each drained and rejoining when it serves again), carrying
out the policy's canary on the replicas, and `live_sample`, which turns a finished request's metrics into
the `RequestSample` the gates read. The canary's record (`Canary`) and the sink of live samples
(`LiveSamples`) are the policy's (policies/canary.py); this module calls them. Must not touch: decisions
(policies/ decides what to promote), HTTP, decoding.

Two kinds of canary. With 2 or more replicas, some replicas swap to the candidate and the router
sends them `fraction` of the requests (the rest keep a replica on the champion). With one replica
(a 2-core machine), the replica itself decodes `fraction` of its requests with the candidate
prepared next to its champion (`set_canary` on the replica, a stable hash of the request id). Either
way each finished request reports the head it used, so `live_samples(version)` is right for both.

Threads: the async methods (`aswap`, `aset_canary`) run on the gateway's event loop (admin
endpoints); the plain methods (`swap`, `set_canary`, ...) are for a controller on another thread and
hop onto that loop. Calling a plain method from the loop's own thread is refused (it would wait on
itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace
from typing import Callable, Optional

from adaptive_eagle.binding import SwapResult
from policies.canary import Canary, LiveSamples
from policies.samples import RequestSample
from serving.messages import SpecMetrics
from serving.router import Router, Slot


def live_sample(spec: SpecMetrics, request_id: str, tokens: int, finished_at: Optional[float] = None) -> RequestSample:
    """A finished request as the policy's gates read it (finished now unless `finished_at` is given)."""
    return RequestSample(accept_length=max(1.0, spec.accept_length), head_version=spec.head_version,
                         domain=spec.domain, request_id=request_id, tpot_s=spec.tpot_s,
                         finished_at=time.time() if finished_at is None else finished_at, tokens=tokens,
                         context=spec.context_position)


class GatewayFleet:
    """Satisfies policies.fleet.Fleet: swap, serving_versions, set_canary, live_samples, cannot_serve."""

    def __init__(self, router: Router, samples: LiveSamples, call_timeout_s: float = 120.0, *,
                 rolling: bool = False, refusal: Optional[Callable[[str], Optional[str]]] = None) -> None:
        """rolling: swap one replica at a time, each drained first and routed nothing until it serves again
        (SGLang replicas: a swap holds SGLang's weight-update lock, or restarts the server); the others keep
        serving meanwhile. Otherwise every replica swaps at once (the reference engine swaps under load).
        refusal: version -> why these replicas can never serve it (SGLang's: sglang_swap.registry_refusal), or
        None; without one every head kind is servable (the reference engine serves dense and MoE heads)."""
        self.router, self.samples, self.call_timeout_s = router, samples, call_timeout_s
        self.rolling, self.refusal = rolling, refusal
        self.loop: Optional[asyncio.AbstractEventLoop] = None  # the gateway's loop (set when it starts)
        self._swap_lock = asyncio.Lock()
        # swaps and canary changes finished so far: statuses read before a change are stale after it (areconcile)
        self.changes = 0

    # ---- the policy's interface (any thread but the gateway's loop) ---------------------------------
    def swap(self, version: str) -> list[SwapResult]:
        # a rolling swap takes one replica's swap (a restart, at worst) per replica
        return self._call(self.aswap(version), len(self.router.slots) if self.rolling else 1)

    def serving_versions(self) -> list[str]:
        """Each replica's confirmed version, in replica order ("none": plain decoding)."""
        return [s.version for s in self.router.slots]

    def set_canary(self, version: Optional[str], fraction: float) -> list[SwapResult]:
        return self._call(self.aset_canary(version, fraction))

    def live_samples(self, version: str, since: float = 0.0) -> list[RequestSample]:
        """Finished requests that decoded with `version` and finished at or after `since` (unix s)."""
        return self.samples.get(version, since)

    def cannot_serve(self, version: str) -> Optional[str]:
        return None if self.refusal is None or version == "none" else self.refusal(version)

    def _call(self, coro, calls: int = 1):
        if self.loop is None:
            coro.close()
            raise RuntimeError("the gateway is not running (its event loop is not known yet)")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise RuntimeError("called on the gateway's own event loop: await aswap/aset_canary instead")
        # each replica call is bounded by call_timeout_s (_bounded); a refusal's swap-backs can double them
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.call_timeout_s * (2 * calls + 1))

    # ---- async implementations -------------------------------------------------------------------
    @property
    def champion(self) -> str:
        """The version the non-canary replicas serve (the most common one)."""
        canary = self.router.canary
        versions = [s.version for s in self.router.slots if canary is None or s.version != canary.version]
        versions = versions or [s.version for s in self.router.slots]
        return max(sorted(set(versions)), key=versions.count)

    async def _swap_one(self, slot: Slot, version: str) -> SwapResult:
        """One replica's swap; rolling: drained first (the router waits for its request in flight and routes it
        nothing more: `Router.hold`), rejoining when the swap returns."""
        if not self.rolling or len(self.router.slots) < 2:
            return await self._bounded(slot, slot.replica.swap_head(version), f"a swap to {version}")
        async with self.router.hold(slot):
            return await self._bounded(slot, slot.replica.swap_head(version), f"a swap to {version}")

    async def _bounded(self, slot: Slot, call, what: str) -> SwapResult:
        """One replica call within call_timeout_s, a refusal after it: a replica actor Ray cannot place (or whose
        node is gone without an error yet) holds its calls, and a swap that waits for it forever would hold the
        fleet's swap lock, and with it every later swap and canary, for good."""
        try:
            return await asyncio.wait_for(call, self.call_timeout_s)
        except asyncio.TimeoutError:
            return SwapResult(False, f"{slot.replica.name} did not answer {what} within {self.call_timeout_s:g} s "
                                     "(its actor is gone or not placed); should it still carry it out, the "
                                     "reconciler routes it by the head its status reports", slot.version)

    async def _swap_slots(self, slots: list[Slot], version: str) -> list[SwapResult]:
        """Swap `slots` to `version` (all at once, or rolling); if any refuses, swap the others back (all or
        nothing). A rolling swap stops at the first refusal: the replicas after it were never touched."""
        before = [s.version for s in slots]
        if self.rolling:  # one at a time, the others serving meanwhile; the first refusal stops the roll
            results: list[SwapResult] = []
            for s in slots:
                results.append(await self._swap_one(s, version))
                if results[-1].ok:
                    self.router.set_version(s.replica, results[-1].version)
                else:
                    break
            tried = len(results)
            results += [SwapResult(False, f"not swapped: {slots[tried - 1].replica.name} refused {version} first "
                                          "(rolling swap)", s.version) for s in slots[tried:]]
        else:
            tried = len(slots)
            results = list(await asyncio.gather(*(self._swap_one(s, version) for s in slots)))
            for s, r in zip(slots, results):
                if r.ok:
                    self.router.set_version(s.replica, r.version)
        refused = [s.replica.name for s, r in zip(slots[:tried], results) if not r.ok]
        if not refused:
            return results
        for s, r, old in zip(slots, results, before):
            if r.ok and old != version:
                back = await self._swap_one(s, old)
                self.router.set_version(s.replica, back.version if back.ok else r.version)
        why = f"; swapped back to the previous head because {', '.join(refused)} refused {version}"
        return [replace(r, ok=False, message=r.message + why) if r.ok else r for r in results]

    async def aswap(self, version: str) -> list[SwapResult]:
        """Every replica serves `version` ("none" = plain decoding); the canary, if any, ends."""
        try:
            return await self._aswap(version)
        finally:
            await self.router.fleet_changed()  # waiting requests re-check which replicas may serve them

    @contextlib.asynccontextmanager
    async def _changing(self):
        """The swap lock, held while the replicas' heads or the canary change; counts the change on release."""
        async with self._swap_lock:
            try:
                yield
            finally:
                self.changes += 1

    async def _aswap(self, version: str) -> list[SwapResult]:
        async with self._changing():
            if self.in_replica_canary and self.router.canary is not None:
                await self._end_in_replica_canary()
            results = await self._swap_slots(list(self.router.slots), version)
            if all(r.ok for r in results):
                self.router.canary = None
            return results

    @property
    def in_replica_canary(self) -> bool:
        """True when canaries run inside the replicas (fewer than 2 replicas)."""
        return len(self.router.slots) < 2

    async def _end_in_replica_canary(self) -> list[SwapResult]:
        self.router.canary = None
        return list(await asyncio.gather(*(self._bounded(s, s.replica.set_canary(None, 0.0), "the canary's end")
                                           for s in self.router.slots)))

    async def _in_replica_canary(self, version: Optional[str], fraction: float) -> list[SwapResult]:
        """Every replica keeps its champion and decodes `fraction` of its requests with `version`."""
        if version is None:
            return await self._end_in_replica_canary()
        if version == self.champion:
            raise ValueError(f"{version} is already the champion")
        results = list(await asyncio.gather(*(self._bounded(s, s.replica.set_canary(version, fraction),
                                                            f"a canary of {version}") for s in self.router.slots)))
        if not all(r.ok for r in results):
            await self._end_in_replica_canary()
            raise ValueError("; ".join(r.message for r in results if not r.ok))
        self.router.canary = Canary(version, fraction)  # no replica serves it whole: the router sends to all
        return results

    async def areconcile(self, statuses: dict, changes: Optional[int] = None) -> list[str]:
        """Bring back a replica whose head is not the one the router routes to it (Ray restarted its actor, which
        came back with the registry's champion, or lost a canary's head): swap it to its slot's version; if it
        refuses, record what it really serves so routing and live samples stay truthful. `statuses`: replica name
        -> ServerStatus (None: it did not answer). `changes`: `self.changes` when the statuses were asked for; if
        a swap or canary change finished since, they may show a head from before it, and nothing is done (the
        next pass asks again). Returns one line per replica it acted on."""
        lines = []
        async with self._swap_lock:  # never while a swap is under way (a replica between two versions)
            if changes is not None and changes != self.changes:
                return lines
            for slot in self.router.slots:
                st = statuses.get(slot.replica.name)
                if st is None or st.head_version == slot.version:
                    continue
                r = await self._bounded(slot, slot.replica.swap_head(slot.version), f"a swap to {slot.version}")
                if r.ok:
                    lines.append(f"{slot.replica.name} served {st.head_version}, routed as {slot.version} "
                                 f"(restarted?): swapped back to {slot.version}")
                else:
                    self.router.set_version(slot.replica, st.head_version)
                    lines.append(f"{slot.replica.name} served {st.head_version} and refused {slot.version} "
                                 f"({r.message}): routed as {st.head_version} from now on")
        if lines:
            await self.router.fleet_changed()
        return lines

    async def aset_canary(self, version: Optional[str], fraction: float) -> list[SwapResult]:
        """Send `fraction` of requests to `version` (replica-based, or inside the one replica: see the
        module docstring); None ends the canary. Raises ValueError when it cannot be set."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        try:
            return await self._aset_canary(version, fraction)
        finally:
            await self.router.fleet_changed()

    async def _aset_canary(self, version: Optional[str], fraction: float) -> list[SwapResult]:
        async with self._changing():
            if self.in_replica_canary:
                return await self._in_replica_canary(version, fraction)
            current, champion = self.router.canary, self.champion
            results: list[SwapResult] = []
            if current is not None and version == current.version:
                self.router.canary = Canary(version, fraction)  # same candidate: only the share changes
                return results
            if current is not None:  # end the running canary: its replicas return to the champion
                self.router.canary = None
                old = [s for s in self.router.slots if s.version == current.version]
                results = await self._swap_slots(old, champion) if champion != current.version else []
            if version is None:
                return results
            n = len(self.router.slots)
            if n < 2:
                raise ValueError("a canary needs at least 2 replicas (one keeps serving the champion); "
                                 f"this gateway has {n}")
            if version == champion:
                raise ValueError(f"{version} is already the champion")
            k = min(n - 1, max(1, round(fraction * n)))
            results = await self._swap_slots(list(reversed(self.router.slots))[:k], version)
            if not all(r.ok for r in results):
                raise ValueError("; ".join(r.message for r in results if not r.ok))
            self.router.canary = Canary(version, fraction)
            return results
