"""The router re-checks a waiting request's eligible replicas after a fleet change: a request queued
for "not the canary" is served once the canary is promoted to every replica, instead of timing out."""

import asyncio

from policies.canary import Canary
from serving.router import Router


class _Replica:
    name = "r"


def test_a_request_waiting_across_a_promotion_is_served():
    async def scenario():
        a, b = _Replica(), _Replica()
        router = Router([a, b], ["v1", "v2"], queue_size=4, wait_timeout_s=60.0)
        router.canary = Canary("v2", 0.0)  # every new request goes to the champion's replica (v1)
        async with router.lease() as first:
            assert first.version == "v1"
            waiter = asyncio.create_task(_lease_version(router))
            await asyncio.sleep(0.05)
            assert not waiter.done()  # v1's replica is busy; v2's is the canary's
            router.set_version(a, "v2")  # promotion: both replicas serve v2, the canary ends
            router.canary = None
            await router.fleet_changed()
            # without the wake the waiter stays queued while v1's replica is leased: the wait below times out.
            # 30 s only stops that case; a loaded machine is never that slow to run the woken coroutine
            assert await asyncio.wait_for(waiter, 30.0) == "v2"

    asyncio.run(scenario())


async def _lease_version(router):
    async with router.lease() as slot:
        return slot.version


def test_a_waiter_whose_woken_slot_turns_ineligible_waits_again_instead_of_failing():
    """A fleet change can land between the wake (the freed slot was eligible) and the waiter resuming;
    the waiter must queue again for an eligible slot, not fail the request (it was a 500 in a live fleet)."""
    async def scenario():
        a, b = _Replica(), _Replica()
        router = Router([a, b], ["v1", "v2"], queue_size=4, wait_timeout_s=60.0)
        router.canary = Canary("v2", 0.0)  # champion requests go to v1's replica only
        lease = router.lease()
        slot = await lease.__aenter__()
        assert slot.version == "v1"
        waiter = asyncio.create_task(_lease_version(router))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await lease.__aexit__(None, None, None)  # frees v1's replica: the waiter's wait ends
        await asyncio.sleep(0)  # the waiter's wake runs and sees v1's replica free ...
        router.set_version(a, "v2")  # ... then a swap turns it into a canary replica before the waiter resumes
        await asyncio.sleep(0.05)
        assert not waiter.done(), waiter  # no slot it may use: it waits (before: AttributeError on a None slot)
        router.set_version(a, "v1")  # the swap rolled back
        await router.fleet_changed()
        assert await asyncio.wait_for(waiter, 30.0) == "v1"

    asyncio.run(scenario())
