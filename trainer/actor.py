"""TrainerActor: the thin Ray shell around one NearlineTrainer (all logic lives in nearline.py and the role
modules it composes: ingest, learner, candidates, checkpointing; tests drive them without Ray).

Owns: building the trainer inside the actor's process, running its loop on a thread of its own
from the moment the actor starts (so an actor that Ray restarts after a crash, `max_restarts`,
resumes from its last checkpoint by itself), ending the process when that loop ends with an error
(the loop rides out store errors itself; what reaches here it cannot handle, and only a dead process
makes Ray restart the actor), and exposing `status`, `events`, `stop` and `inject_fault` (rehearsals) as async methods that answer
while a step runs. Must not touch: anything but forwarding and that one fault.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from typing import Callable

from adaptive_eagle.targets import Target
from feature_store.config import REVEAL_SECRETS
from trainer.config import NearlineConfig
from trainer.nearline import NearlineTrainer

log = logging.getLogger(__name__)


def end_process(error: BaseException) -> None:
    """The default `on_fatal`: end this process at once (no clean-up that could hang), exit status 1, so
    Ray restarts the actor (`max_restarts`) and the new one resumes from the last checkpoint."""
    logging.shutdown()  # flush the log lines that say why
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


class TrainerActor:
    """Use as `ray.remote(TrainerActor).options(max_restarts=...).remote(config_json, target_builder, yield_to)`.
    target_builder: None loads the configured (or the champion's) target in the actor's process.
    yield_to: called before each step; True makes the trainer wait (requests queue on shared cores).
    on_fatal: called with the error that ended the loop, after it is logged with its traceback (default
    `end_process`; tests pass a recorder)."""

    def __init__(self, config_json: str, target_builder: Callable[[], Target] | None = None,
                 yield_to: Callable[[], bool] | None = None,
                 on_fatal: Callable[[BaseException], None] = end_process) -> None:
        cfg = NearlineConfig.model_validate_json(config_json)
        self.trainer = NearlineTrainer(cfg, target=target_builder() if target_builder is not None else None,
                                       yield_to=yield_to, worker_target=target_builder)
        self._stop = threading.Event()
        self.error: str | None = None
        self.on_fatal = on_fatal
        self._thread = threading.Thread(target=self._loop, name="nearline-trainer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            self.trainer.run(self._stop)
            if not self._stop.is_set():
                raise RuntimeError("the trainer's loop returned without being stopped")
        except BaseException as e:  # noqa: BLE001  whatever ends the loop ends the process
            self.error = f"{type(e).__name__}: {e}"
            self.trainer.state = f"error: {self.error}"
            log.critical("near-line trainer loop failed; ending the process so Ray restarts the actor",
                         exc_info=e)
            self.on_fatal(e)
        finally:
            self.trainer.close()  # the store reader, and a data-parallel worker group if one runs

    async def status(self) -> dict:
        status = self.trainer.status().to_dict()
        if not self._thread.is_alive() and not status["state"].startswith(("stopped", "error")):
            status["state"] = "error: the trainer's loop is not running"  # never healthy without a loop
        return status

    async def events(self, last: int = 50) -> list[str]:
        return list(self.trainer.events)[-last:]

    async def inject_fault(self, message: str = "fault injected into a trainer step") -> None:
        """Fault injection (rehearsals): the next step raises, which ends this process like any bug in a step."""
        self.trainer.inject_step_fault(message)

    async def stop(self, timeout_s: float = 60.0) -> dict:
        """Stop after the current step, checkpoint, and return the final status."""
        self._stop.set()
        await asyncio.to_thread(self._thread.join, timeout_s)
        return await self.status()


def actor_config_json(cfg: NearlineConfig) -> str:
    """The config the actor is built from, as JSON with the store's password in it (a plain dump masks it, and
    a trainer with a masked password is refused by a Redis that has AUTH)."""
    return cfg.model_dump_json(context={REVEAL_SECRETS: True})


def remote_trainer_actor(cfg: NearlineConfig, target_builder: Callable[[], Target] | None = None,
                         max_restarts: int = 5, yield_to: Callable[[], bool] | None = None, **options):
    """Start a TrainerActor (`options`: Ray actor options such as num_cpus, num_gpus) and return its handle.
    The actor ends its process when its loop fails; Ray starts a new one up to `max_restarts` times."""
    import ray

    return ray.remote(TrainerActor).options(max_restarts=max_restarts, **options).remote(
        actor_config_json(cfg), target_builder, yield_to)


__all__ = ["TrainerActor", "actor_config_json", "end_process", "remote_trainer_actor"]
