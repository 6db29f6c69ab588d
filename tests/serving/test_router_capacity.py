"""The router leases each replica up to its capacity (max_inflight: 1 for the reference engine, SGLang's batch
for an SGLang replica), to the least-loaded eligible replica first; a hold drains every request in flight on
its replica and routes it nothing meanwhile; the canary's share holds with many requests in flight."""

import asyncio
import random
from collections import Counter
from contextlib import AsyncExitStack

import pytest

from policies.canary import Canary
from serving.router import QueueFull, Router


class _Replica:
    def __init__(self, name: str, max_inflight: int) -> None:
        self.name, self.max_inflight = name, max_inflight


def test_one_replica_takes_up_to_its_capacity_then_requests_queue_and_then_are_refused():
    async def scenario():
        router = Router([_Replica("a", 4)], ["v1"], queue_size=1, wait_timeout_s=30.0)
        async with AsyncExitStack() as held:
            for _ in range(4):
                await held.enter_async_context(router.lease())
            assert router.inflight == 4 and router.busy == 1 and router.capacity == 4
            waiter = asyncio.create_task(_lease_name(router))
            await asyncio.sleep(0.02)
            assert not waiter.done() and router.waiting == 1
            with pytest.raises(QueueFull, match="full"):
                async with router.lease():
                    pass
        assert await asyncio.wait_for(waiter, 10.0) == "a"
        assert router.inflight == 0

    asyncio.run(scenario())


async def _lease_name(router, hold_s: float = 0.0, head=None):
    async with router.lease(head) as slot:
        await asyncio.sleep(hold_s)
        return slot.replica.name


def test_requests_go_to_the_least_loaded_replica_by_share_of_its_capacity():
    async def scenario():
        big, small = _Replica("big", 6), _Replica("small", 2)
        router = Router([small, big], ["v1", "v1"], queue_size=8, wait_timeout_s=30.0)
        async with AsyncExitStack() as held:
            names = [(await held.enter_async_context(router.lease())).replica.name for _ in range(8)]
            assert Counter(names) == {"big": 6, "small": 2}
            # loads in lease order: small and big take turns until small is half full, then big catches up
            assert names[:2] == ["small", "big"] and router.slots[0].load == router.slots[1].load == 1.0

    asyncio.run(scenario())


def test_a_hold_drains_every_request_in_flight_on_its_replica_and_routes_it_nothing_meanwhile():
    async def scenario():
        a, b = _Replica("a", 4), _Replica("b", 4)
        router = Router([a, b], ["v1", "v1"], queue_size=16, wait_timeout_s=30.0)
        stack = AsyncExitStack()
        on_a = []
        for _ in range(6):  # a gets three, b three
            slot = await stack.enter_async_context(router.lease())
            if slot.replica is a:
                on_a.append(slot)
        assert len(on_a) == 3
        entered = asyncio.Event()

        async def swap():
            async with router.hold(router.slots[0]):
                assert router.slots[0].inflight == 0  # drained
                entered.set()
                await asyncio.sleep(0.05)
                news = [await _lease_name(router) for _ in range(3)]
                assert news == ["b"] * 3  # nothing new to the held replica, even with room on it
        task = asyncio.create_task(swap())
        await asyncio.sleep(0.02)
        assert not entered.is_set()  # a's three requests are still in flight: the hold waits
        assert [await _lease_name(router) for _ in range(1)] == ["b"]  # held already: new requests avoid a
        await stack.aclose()  # every request in flight finishes
        await asyncio.wait_for(task, 10.0)
        assert await _lease_name(router) == "a"  # back in rotation after the hold

    asyncio.run(scenario())


def test_the_canary_share_holds_with_many_requests_in_flight():
    async def scenario():
        champion, candidate = _Replica("champion", 32), _Replica("candidate", 32)
        router = Router([champion, candidate], ["v1", "cand"], queue_size=400, wait_timeout_s=60.0,
                        rng=random.Random(7))
        router.canary = Canary("cand", 0.25)
        peak = []

        async def one():
            async with router.lease() as slot:
                peak.append(router.inflight)
                await asyncio.sleep(0.01)
                return slot.replica.name

        names = await asyncio.gather(*(one() for _ in range(400)))
        share = Counter(names)["candidate"] / len(names)
        assert 0.19 < share < 0.31, share  # 400 draws at 0.25: outside this is < 0.5% likely
        assert max(peak) > 32 and router.inflight == 0  # more in flight at once than one replica could take

    asyncio.run(scenario())


def test_a_suspect_replica_is_passed_over_while_a_healthy_one_may_serve_and_tried_when_none_can():
    """A replica that just failed (its node may be gone) takes no new request while a healthy replica may serve
    it, even a full one: the request waits for the healthy replica's free slot. With only suspects, they serve."""
    async def scenario():
        dead, alive = _Replica("dead", 1), _Replica("alive", 1)
        router = Router([dead, alive], ["v1", "v1"], queue_size=4, wait_timeout_s=30.0)
        router.replica_failed(dead)
        assert router.suspects() == ["dead"]
        lease = router.lease()
        assert (await lease.__aenter__()).replica is alive  # dead is idle (least load) and still passed over
        waiter = asyncio.create_task(_lease_name(router))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # alive is full: the request waits for it rather than trying dead
        await lease.__aexit__(None, None, None)
        assert await asyncio.wait_for(waiter, 10.0) == "alive"
        router.replica_failed(alive)  # both suspect: no healthy replica may serve, so the suspects are tried
        assert await _lease_name(router) == "dead"
        router.replica_ok(dead)
        assert router.suspects() == ["alive"] and await _lease_name(router) == "dead"

    asyncio.run(scenario())
