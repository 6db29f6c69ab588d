"""TrainerActor: the near-line trainer as a real Ray actor: trains from the store, answers status while
it trains, stops with a checkpoint; a loop that fails ends the process (on_fatal) and Ray restarts it."""

import asyncio
import functools
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from tests.trainer.test_nearline import setup_run, world  # noqa: F401  (module fixture)
from trainer.actor import TrainerActor, remote_trainer_actor

REPO = Path(__file__).resolve().parents[2]


def tiny_builder():
    from tests.adaptive_eagle.test_engine import tiny_setup

    return tiny_setup(seed=11, dtype=torch.float32)[0]


def test_trainer_actor_trains_from_the_store_and_stops_with_a_checkpoint(ray_session, tmp_path, world):  # noqa: F811
    cfg, _ = setup_run(tmp_path, world, checkpoint_every_s=0.5, poll_ms=50)
    actor = remote_trainer_actor(cfg, tiny_builder, num_cpus=0)
    deadline = time.monotonic() + 600  # only a hang fails: a loaded machine steps slowly
    status = ray_session.get(actor.status.remote())
    while status["steps"] < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
        status = ray_session.get(actor.status.remote())
    assert status["steps"] >= 2 and status["champion"] == "v1" and status["records_seen"] > 0
    final = ray_session.get(actor.stop.remote())
    assert final["state"] == "stopped"
    assert (tmp_path / "work" / "state" / "trainer.json").exists()
    events = ray_session.get(actor.events.remote())
    assert any("training from champion v1" in e for e in events)
    ray_session.kill(actor)


def _load_signal_unreadable() -> bool:
    raise ValueError("load signal unreadable")


def test_a_loop_error_that_is_not_the_stores_calls_on_fatal_and_the_status_says_error(tmp_path, world):  # noqa: F811
    """The plain class, without Ray: on_fatal stands in for ending the process."""
    cfg, _ = setup_run(tmp_path, world, poll_ms=20)
    fatal: list[BaseException] = []
    ended = threading.Event()
    actor = TrainerActor(cfg.model_dump_json(), tiny_builder, yield_to=_load_signal_unreadable,
                         on_fatal=lambda e: (fatal.append(e), ended.set()))
    assert ended.wait(120), "on_fatal was not called"
    actor._thread.join(60)
    assert len(fatal) == 1 and isinstance(fatal[0], ValueError) and actor.error == "ValueError: load signal unreadable"
    status = asyncio.run(actor.status())
    assert status["state"] == "error: ValueError: load signal unreadable" and status["errors_total"] == 1
    assert status["last_error"] == "ValueError: load signal unreadable"
    assert (tmp_path / "work" / "state" / "trainer.json").exists()  # checkpointed on the way out


def test_the_default_on_fatal_ends_the_process_with_status_1():
    code = "from trainer.actor import end_process\nend_process(ValueError('x'))\nprint('still alive')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 1 and "still alive" not in res.stdout, res.stderr[-2000:]


def _fail_in_the_first_process(marker: str) -> bool:
    """yield_to for the restart test: raises once (leaving `marker`), then never asks the trainer to wait."""
    if not Path(marker).exists():
        Path(marker).write_text("failed once")
        raise RuntimeError("injected fault")
    return False


def test_ray_restarts_a_trainer_whose_loop_failed_and_it_resumes(ray_session, tmp_path, world):  # noqa: F811
    cfg, _ = setup_run(tmp_path, world, checkpoint_every_s=0.5, poll_ms=50)
    marker = tmp_path / "failed-once"
    actor = remote_trainer_actor(cfg, tiny_builder, max_restarts=1, num_cpus=0,
                                 yield_to=functools.partial(_fail_in_the_first_process, str(marker)))
    deadline, status = time.monotonic() + 300, None
    while not (marker.exists() and status and status["steps"] >= 1):
        assert time.monotonic() < deadline, f"no step after a restart: {status}"
        time.sleep(0.2)
        try:
            status = ray_session.get(actor.status.remote(), timeout=60)
        except ray_session.exceptions.RayError:  # the process ended; Ray is starting a new one
            status = None
    # the first process failed before any step: this one is the restarted actor, resumed from the checkpoint
    assert status["errors_total"] == 0 and status["state"] in ("waiting", "training", "evaluating")
    assert any("resumed from checkpoint" in e for e in ray_session.get(actor.events.remote()))
    assert ray_session.get(actor.stop.remote())["state"] == "stopped"
    ray_session.kill(actor)


def test_an_injected_step_fault_ends_the_loop_like_a_bug_in_a_step(tmp_path, world):  # noqa: F811
    """inject_fault (rehearsals) arms the next step to raise: the loop ends through on_fatal, as a real bug would."""
    import os

    from trainer.nearline import InjectedFault

    cfg, _ = setup_run(tmp_path, world, poll_ms=20)
    fatal: list[BaseException] = []
    ended = threading.Event()
    actor = TrainerActor(cfg.model_dump_json(), tiny_builder, on_fatal=lambda e: (fatal.append(e), ended.set()))
    try:
        assert asyncio.run(actor.status())["pid"] == os.getpid()
        asyncio.run(actor.inject_fault("rehearsal: step fault"))
        assert ended.wait(300), "on_fatal was not called"
        actor._thread.join(60)
        assert len(fatal) == 1 and isinstance(fatal[0], InjectedFault)
        status = asyncio.run(actor.status())
        assert status["state"] == "error: InjectedFault: rehearsal: step fault"
    finally:
        actor._stop.set()


def test_the_actor_gets_the_store_password_that_a_plain_dump_masks(tmp_path):
    from feature_store.config import StoreConfig
    from trainer.actor import actor_config_json
    from trainer.config import NearlineConfig

    store = StoreConfig(backend="redis", redis_url="rediss://localhost:6380/0", redis_password="s3cret-pw")
    cfg = NearlineConfig(registry=str(tmp_path / "reg"), work_dir=str(tmp_path / "work"), store=store)
    assert "s3cret-pw" not in cfg.model_dump_json()  # logs and files never see it
    got = NearlineConfig.model_validate_json(actor_config_json(cfg)).store.redis_password
    assert got is not None and got.get_secret_value() == "s3cret-pw"  # was "**********": Redis said WRONGPASS
