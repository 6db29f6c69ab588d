"""TrainerActor: the near-line trainer as a real Ray actor: trains from the store, answers status while
it trains, stops with a checkpoint."""

import time

import torch

from tests.trainer.test_nearline import setup_run, world  # noqa: F401  (module fixture)
from trainer.actor import remote_trainer_actor


def tiny_builder():
    from tests.adaptive_eagle.test_engine import tiny_setup

    return tiny_setup(seed=11, dtype=torch.float32)[0]


def test_trainer_actor_trains_from_the_store_and_stops_with_a_checkpoint(ray_session, tmp_path, world):  # noqa: F811
    cfg, _ = setup_run(tmp_path, world, checkpoint_every_s=0.5, poll_ms=50)
    actor = remote_trainer_actor(cfg, tiny_builder, num_cpus=0)
    deadline = time.monotonic() + 60
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
