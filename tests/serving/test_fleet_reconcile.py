"""A replica whose actor Ray restarted comes back with the registry's champion; if it carried a canary, the router
still routes the canary's share to it and the canary never gets a sample (found by the production rehearsal:
the policy waited on a canary for the rest of the run). The fleet swaps such a replica back to the head it is
routed as, or, if it refuses, routes it as what it serves."""

import asyncio

from adaptive_eagle.binding import SwapResult
from policies.canary import Canary, LiveSamples
from serving.fleet import GatewayFleet
from serving.messages import ServerStatus
from serving.router import Router


class Replica:
    """A stand-in replica (test code): it serves `head` and swaps to versions in `known`."""

    def __init__(self, name: str, head: str, known=("v1", "cand")) -> None:
        self.name, self.head, self.known, self.swaps = name, head, set(known), []

    async def swap_head(self, version: str) -> SwapResult:
        self.swaps.append(version)
        if version not in self.known:
            return SwapResult(False, f"{version} is not in the registry", self.head)
        self.head = version
        return SwapResult(True, f"serving {version}", version)

    def status(self) -> ServerStatus:
        return ServerStatus(replica=self.name, head_version=self.head, backend="stand-in", running=0, waiting=0,
                            served=0, refused=0, failed=0, cancelled=0)


def test_a_restarted_canary_replica_is_swapped_back_and_a_refusing_one_is_routed_as_what_it_serves():
    async def scenario():
        a, b = Replica("a", "v1"), Replica("b", "cand")
        router = Router([a, b], ["v1", "cand"], queue_size=4, wait_timeout_s=10.0)
        router.canary = Canary("cand", 0.1)
        fleet = GatewayFleet(router, LiveSamples())
        assert await fleet.areconcile({"a": a.status(), "b": b.status()}) == []  # in sync: nothing to do
        b.head = "v1"  # Ray restarted b: it loaded the registry's champion
        lines = await fleet.areconcile({"a": a.status(), "b": b.status(), "c": None})
        assert b.swaps == ["cand"] and b.head == "cand" and len(lines) == 1 and "swapped back" in lines[0]
        assert [s.version for s in router.slots] == ["v1", "cand"]
        b.head, b.known = "v1", {"v1"}  # restarted again, and now the candidate cannot be loaded
        lines = await fleet.areconcile({"a": a.status(), "b": b.status()})
        assert "routed as v1" in lines[0] and "not in the registry" in lines[0]
        assert [s.version for s in router.slots] == ["v1", "v1"]
        assert a.swaps == []  # a replica that is in sync is never touched

    asyncio.run(scenario())


def test_statuses_read_before_a_promotion_do_not_swap_back_or_cry_restart():
    """The gateway's reconcile pass asks every replica's status, then waits for the swap lock; a promotion that
    swaps the fleet meanwhile makes those statuses stale (found in three continual runs: at each promotion the
    on-call log read "replica-0 served <old champion>, routed as <new> (restarted?)" though nothing restarted).
    Statuses from before a finished change are dropped; the next pass, with fresh ones, acts on a real
    restart."""
    async def scenario():
        a = Replica("a", "v1")
        router = Router([a], ["v1"], queue_size=4, wait_timeout_s=10.0)
        fleet = GatewayFleet(router, LiveSamples())
        changes, stale = fleet.changes, {"a": a.status()}  # the pass read v1 ...
        await fleet.aswap("cand")  # ... and the promotion swapped to cand before it got the lock
        assert a.head == "cand" and a.swaps == ["cand"]
        assert await fleet.areconcile(stale, changes) == [] and a.swaps == ["cand"]
        a.head = "v1"  # a real restart after the promotion: the next pass sees it with fresh statuses
        lines = await fleet.areconcile({"a": a.status()}, fleet.changes)
        assert len(lines) == 1 and "swapped back to cand" in lines[0] and a.head == "cand"

    asyncio.run(scenario())


class SlowReplica(Replica):
    """A stand-in replica (test code) whose swap takes a while, like an SGLang restart; it records what else was
    swapping when it started, and the requests routed to it."""

    swapping: set = set()

    def __init__(self, name, head, known=("v1", "cand")):
        super().__init__(name, head, known)
        self.overlapped = []

    async def swap_head(self, version: str) -> SwapResult:
        self.overlapped.append(set(SlowReplica.swapping))
        SlowReplica.swapping.add(self.name)
        await asyncio.sleep(0.05)
        SlowReplica.swapping.discard(self.name)
        return await super().swap_head(version)


def test_sglang_replicas_swap_one_at_a_time_drained_while_the_others_serve():
    """rolling=True (the gateway sets it for SGLang replicas): each replica is drained (its request in flight
    finishes, nothing new is routed to it) and swapped alone; requests keep going to the replicas not swapping;
    the first refusal stops the roll and the replicas already swapped go back."""
    async def scenario():
        SlowReplica.swapping = set()
        reps = [SlowReplica(n, "v1") for n in "abc"]
        router = Router(reps, ["v1"] * 3, queue_size=8, wait_timeout_s=10.0)
        fleet = GatewayFleet(router, LiveSamples(), rolling=True)
        served = []

        async def traffic():
            for _ in range(40):
                async with router.lease() as slot:
                    served.append((slot.replica.name, set(SlowReplica.swapping)))
                    await asyncio.sleep(0.005)

        results, _ = await asyncio.gather(fleet.aswap("cand"), traffic())
        assert all(r.ok for r in results) and [s.version for s in router.slots] == ["cand"] * 3
        assert all(r.overlapped == [set()] for r in reps)  # never two swapping at once
        assert all(name not in swapping for name, swapping in served)  # no request on a replica while it swaps
        for r in reps:
            r.known = {"v1", "cand", "v2"}
        reps[1].known = {"v1", "cand"}  # b cannot load the next version
        results = await fleet.aswap("v2")
        assert [r.ok for r in results] == [False, False, False]
        assert "swapped back" in results[0].message and "v2 is not in the registry" in results[1].message
        assert "not swapped" in results[2].message and reps[2].swaps[-1] == "cand"  # c never touched
        assert [s.version for s in router.slots] == ["cand"] * 3 and reps[0].swaps[-2:] == ["v2", "cand"]

    asyncio.run(scenario())


class SilentReplica(Replica):
    """A replica actor Ray could not place: every call waits, without an error."""

    async def swap_head(self, version: str) -> SwapResult:
        self.swaps.append(version)
        await asyncio.Event().wait()


def test_a_swap_a_silent_replica_never_answers_is_refused_in_time_and_frees_the_fleet():
    """Without a bound the swap would wait forever holding the fleet's swap lock: every later swap, canary and
    reconcile would wait behind it (the cluster bench saw the policy's ticks time out one after another)."""
    async def scenario():
        a, b = Replica("a", "v1"), SilentReplica("b", "v1")
        router = Router([a, b], ["v1", "v1"], queue_size=4, wait_timeout_s=10.0)
        fleet = GatewayFleet(router, LiveSamples(), call_timeout_s=0.2)
        results = await asyncio.wait_for(fleet.aswap("cand"), 5.0)
        assert results[0].ok is False and "swapped back" in results[0].message  # all or nothing
        assert not results[1].ok and "did not answer" in results[1].message
        assert a.head == "v1" and fleet.serving_versions() == ["v1", "v1"]
        assert not fleet._swap_lock.locked()
        b.__class__ = Replica  # its node joined: it answers now
        assert all(r.ok for r in await asyncio.wait_for(fleet.aswap("cand"), 5.0))

    asyncio.run(scenario())
