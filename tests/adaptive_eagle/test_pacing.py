"""Pacing a hot swap's preparation: the work keeps to its share of a core, and a paced load is the same load."""

import pytest
import torch

from adaptive_eagle.pacing import Pacer


class SimulatedClock:
    """A wall clock that moves only when work or a pause moves it: the pacer's arithmetic, checked exactly and
    independently of how busy the machine running the test is. A pause may overshoot (as real sleeps do)."""

    def __init__(self, overshoot_s: float = 0.0) -> None:
        self.now, self.overshoot_s = 100.0, overshoot_s

    def __call__(self) -> float:
        return self.now

    def work(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.now += seconds + self.overshoot_s


def test_a_pacer_keeps_work_to_its_share_of_the_wall_time():
    clock = SimulatedClock(overshoot_s=0.0005)
    pacer = Pacer(0.25, clock=clock, sleep=clock.sleep)
    t0 = clock()
    for _ in range(20):
        clock.work(0.002)
        pacer.tick()
    wall = clock() - t0
    assert pacer.worked_s == pytest.approx(0.04)  # a pause's overshoot is not counted as work
    assert pacer.paused_s == pytest.approx(3 * pacer.worked_s)  # 1 - share of the wall time, share 0.25
    assert pacer.worked_s / wall <= 0.25
    clock.work(1.0)  # a long unit (a preempted one) pauses at most max_pause_s
    pacer.tick()
    assert pacer.paused_s == pytest.approx(0.12 + pacer.max_pause_s)
    unpaced = Pacer(1.0, clock=clock, sleep=clock.sleep)
    clock.work(0.002)
    unpaced.tick()
    assert unpaced.paused_s == 0.0 and unpaced.worked_s == pytest.approx(0.002)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="share"):
            Pacer(bad)


def test_a_paced_load_is_bit_identical_to_an_unpaced_one(tmp_path):
    """Checksum in 1 MiB units, tensors checked one by one, large tensors converted in blocks of rows."""
    from adaptive_eagle.checkpoint import HeadMeta, load_head, save_head
    from tests.adaptive_eagle.test_engine import tiny_setup

    target, head = tiny_setup(seed=5)
    save_head(head, tmp_path / "v", HeadMeta.new("v", target.name, target.fingerprint), dtype=torch.bfloat16)
    big = torch.randn(3000, 200).bfloat16()  # 1.2 MB: converted in blocks
    from adaptive_eagle.checkpoint import _cast

    pacer = Pacer(0.5)
    assert torch.equal(_cast(big, torch.float32, pacer), big.float()) and pacer.worked_s > 0
    plain = load_head(tmp_path / "v", target, dtype=torch.float32)
    paced = load_head(tmp_path / "v", target, dtype=torch.float32, pace=Pacer(0.5))
    a, b = plain.head.state_dict(), paced.head.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
