"""policies.actor: the async shell drives the controller (consider, tick, on-call ops) and its loop
survives a failing tick; Ray is only needed by policy_actor()."""

from __future__ import annotations

import asyncio
import shutil

from policies.actor import PolicyActor, policy_actor
from policies.gates import PROMOTE
from tests.policies.fleets import LocalFleet
from tests.policies.replicas import RecordingReplica
from tests.policies.helpers import replay


def test_actor_shell_runs_the_controller(tmp_path, registry_template):
    root = tmp_path / "registry"
    shutil.copytree(registry_template, root)
    fleet = LocalFleet([RecordingReplica(), RecordingReplica()])
    actor = PolicyActor(root, fleet, {"canary_min_requests": 50, "bootstrap_resamples": 300})

    async def scenario():
        _, candidate = replay(0.0, 0.3, candidate="v1")
        decision = await actor.consider("v1", [], candidate)  # cold start: the registry's champion is 'none'
        assert decision.action == PROMOTE and (await actor.status())["state"] == "canary"
        calls = []

        def flaky_tick():
            calls.append(1)
            if len(calls) == 1:
                raise OSError("registry on a flaky mount")
            return None

        actor.controller.tick = flaky_tick
        loop = asyncio.create_task(actor.run(interval_s=0.01))
        while len(calls) < 3:
            await asyncio.sleep(0.01)
        assert (await actor.status())["running"]
        await actor.stop()
        assert await loop >= 3 and actor.tick_errors == 1

    asyncio.run(scenario())
    assert (root / "promotions.jsonl").is_file()  # default log: <registry>/promotions.jsonl


def test_policy_actor_is_a_ray_actor_class():
    cls = policy_actor(num_cpus=0)
    assert hasattr(cls, "remote") and hasattr(cls, "options")
