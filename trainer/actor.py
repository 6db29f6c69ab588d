"""TrainerActor: the thin Ray shell around one NearlineTrainer (all logic lives in nearline.py, which
tests drive without Ray).

Owns: building the trainer inside the actor's process, running its loop on a thread of its own
from the moment the actor starts (so an actor that Ray restarts after a crash, `max_restarts`,
resumes from its last checkpoint by itself), and exposing `status`, `events` and `stop` as async
methods that answer while a step runs. Must not touch: anything but forwarding.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

from adaptive_eagle.targets import Target
from trainer.config import NearlineConfig
from trainer.nearline import NearlineTrainer


class TrainerActor:
    """Use as `ray.remote(TrainerActor).options(max_restarts=...).remote(config_json, target_builder, yield_to)`.
    target_builder: None loads the configured (or the champion's) target in the actor's process.
    yield_to: called before each step; True makes the trainer wait (requests queue on shared cores)."""

    def __init__(self, config_json: str, target_builder: Callable[[], Target] | None = None,
                 yield_to: Callable[[], bool] | None = None) -> None:
        cfg = NearlineConfig.model_validate_json(config_json)
        self.trainer = NearlineTrainer(cfg, target=target_builder() if target_builder is not None else None,
                                       yield_to=yield_to, worker_target=target_builder)
        self._stop = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="nearline-trainer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            self.trainer.run(self._stop)
        except Exception as e:  # the status says why; Ray restarts the actor only if the process dies
            self.error = f"{type(e).__name__}: {e}"
            self.trainer.state = f"error: {self.error}"
            raise
        finally:
            self.trainer.close()  # the store reader, and a data-parallel worker group if one runs

    async def status(self) -> dict:
        return self.trainer.status().to_dict()

    async def events(self, last: int = 50) -> list[str]:
        return list(self.trainer.events)[-last:]

    async def stop(self, timeout_s: float = 60.0) -> dict:
        """Stop after the current step, checkpoint, and return the final status."""
        self._stop.set()
        await asyncio.to_thread(self._thread.join, timeout_s)
        return self.trainer.status().to_dict()


def remote_trainer_actor(cfg: NearlineConfig, target_builder: Callable[[], Target] | None = None,
                         max_restarts: int = 5, yield_to: Callable[[], bool] | None = None, **options):
    """Start a TrainerActor (`options`: Ray actor options such as num_cpus, num_gpus) and return its handle."""
    import ray

    return ray.remote(TrainerActor).options(max_restarts=max_restarts, **options).remote(
        cfg.model_dump_json(), target_builder, yield_to)


__all__ = ["TrainerActor", "remote_trainer_actor"]
