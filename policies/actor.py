"""PolicyActor: the thin async shell that runs a PolicyController in a Ray actor (or in plain asyncio).

Owns: the polling loop (``run``: tick every ``interval_s`` until ``stop``) and moving the controller's
blocking calls off the event loop. Must not touch: decisions (``policies.controller``, ``policies.gates``);
Ray itself is imported only by ``policy_actor()``, so ``import policies.actor`` works without Ray.

The fleet is passed in (it must be picklable to cross into a Ray actor: the serving package's fleet
holds actor handles); the registry is opened inside the actor from its root, and the promotion log
defaults to ``<registry>/promotions.jsonl``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Sequence

from policies.config import PolicyConfig
from policies.controller import PolicyController
from policies.fleet import Fleet
from policies.gates import Decision
from policies.log import LOG_NAME, PromotionLog
from policies.samples import RequestSample

log = logging.getLogger(__name__)


class PolicyActor:
    """Every method is a coroutine; the controller's work runs in a worker thread (its own lock orders it)."""

    def __init__(self, registry: str | os.PathLike, fleet: Fleet, config: PolicyConfig | dict | None = None,
                 log_path: str | os.PathLike | None = None) -> None:
        from adaptive_eagle.registry import HeadRegistry  # torch lives here; the controller never imports it

        config = config if isinstance(config, PolicyConfig) else PolicyConfig.make(**(config or {}))
        reg = HeadRegistry(registry)
        plog = PromotionLog(log_path if log_path is not None else Path(registry) / LOG_NAME)
        self.controller = PolicyController(reg, fleet, plog, config)
        self._stop: asyncio.Event | None = None
        self.tick_errors = 0

    async def consider(self, candidate: str, replay_champion: Sequence[RequestSample],
                       replay_candidate: Sequence[RequestSample], exact_replay: bool = False,
                       sequential: bool = False, final: bool = False) -> Decision:
        return await asyncio.to_thread(self.controller.consider, candidate, replay_champion, replay_candidate,
                                       exact_replay=exact_replay, sequential=sequential, final=final)

    async def tick(self) -> Decision | None:
        return await asyncio.to_thread(self.controller.tick)

    async def status(self) -> dict:
        return {**await asyncio.to_thread(self.controller.status), "tick_errors": self.tick_errors,
                "running": self._stop is not None and not self._stop.is_set()}

    async def rollback(self, reason: str = "") -> Decision:
        return await asyncio.to_thread(self.controller.rollback, reason)

    async def pin(self, version: str, reason: str = "") -> Decision:
        return await asyncio.to_thread(self.controller.pin, version, reason)

    async def unpin(self) -> Decision:
        return await asyncio.to_thread(self.controller.unpin)

    async def run(self, interval_s: float = 2.0) -> int:
        """Tick every `interval_s` until stop(); returns the number of ticks. A tick that raises is logged
        and counted (tick_errors), and the loop goes on: one bad read must not end the watch."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._stop = stop = asyncio.Event()
        ticks = 0
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - logged with its traceback, counted, and the loop goes on
                self.tick_errors += 1
                log.exception("policy tick failed")
            ticks += 1
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except asyncio.TimeoutError:
                pass
        return ticks

    async def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()


def policy_actor(**ray_options):
    """The Ray actor class: ``policy_actor().remote(registry_root, fleet, config)``. Defaults: no CPU
    reserved (the controller mostly waits), one replica of the actor restarted on failure."""
    import ray

    options = {"num_cpus": 0, "max_restarts": 1, **ray_options}
    return ray.remote(**options)(PolicyActor)


__all__ = ["PolicyActor", "policy_actor"]
