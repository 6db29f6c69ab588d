"""policies.canary: the canary's record, its per-request decision (a stable hash of the request id, pinned
here to exact values: a changed hash would route other requests to the candidate), and the live-sample
sink, bounded per head version and read by version and time."""

from __future__ import annotations

import threading

import pytest

from policies.canary import Canary, LiveSamples, unit_hash
from policies.samples import RequestSample


@pytest.mark.parametrize("request_id,crc", [("req-0", 436743079), ("req-1", 1829706545), ("q0", 1361341156),
                                            ("r1", 219023793), ("", 0), ("é", 235179326)])
def test_the_request_hash_is_crc32_of_the_utf8_id_over_2_to_the_32(request_id, crc):
    assert unit_hash(request_id) == crc / 2**32 and 0.0 <= unit_hash(request_id) < 1.0


def test_a_canary_takes_a_stable_share_of_request_ids():
    ids = [f"r{i}" for i in range(4000)]
    canary = Canary("v2", 0.25)
    taken = [canary.takes(i) for i in ids]
    assert abs(sum(taken) / len(ids) - 0.25) < 0.03 and taken == [canary.takes(i) for i in ids]
    assert taken == [unit_hash(i) < 0.25 for i in ids]
    assert not any(Canary("v2", 0.0).takes(i) for i in ids) and all(Canary("v2", 1.0).takes(i) for i in ids)
    wider = Canary("v2", 0.5)
    assert all(wider.takes(i) for i, t in zip(ids, taken) if t)  # a larger share keeps the ids it had


def test_a_draw_goes_to_the_candidate_below_the_share():
    canary = Canary("v2", 0.3)
    assert canary.takes_draw(0.0) and canary.takes_draw(0.2999) and not canary.takes_draw(0.3)
    assert not Canary("v2", 0.0).takes_draw(0.0)


def test_the_record_is_frozen_checked_and_written_as_json():
    canary = Canary("v2", 0.5)
    assert canary == Canary("v2", 0.5) and canary.to_json() == {"version": "v2", "fraction": 0.5}
    with pytest.raises(AttributeError):
        canary.fraction = 0.1
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="fraction"):
            Canary("v2", bad)


def test_live_samples_by_version_and_time_bounded_per_version():
    sink = LiveSamples(max_per_version=3)
    for t, v in [(1.0, "v1"), (2.0, "v2"), (3.0, "v1"), (4.0, "v1"), (5.0, "v1")]:
        sink.add(RequestSample(1.5, v, finished_at=t))
    assert [s.finished_at for s in sink.get("v1")] == [3.0, 4.0, 5.0]  # the oldest v1 fell off
    assert [s.finished_at for s in sink.get("v2")] == [2.0]  # another version's bound is its own
    assert [s.finished_at for s in sink.get("v1", since=4.0)] == [4.0, 5.0] and sink.get("v3") == []
    with pytest.raises(ValueError, match="max_per_version"):
        LiveSamples(0)


def test_live_samples_take_records_from_several_threads():
    sink = LiveSamples()

    def record(k: int) -> None:
        for i in range(500):
            sink.add(RequestSample(1.5, f"v{k % 2}", request_id=f"{k}-{i}", finished_at=float(i)))

    threads = [threading.Thread(target=record, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(sink.get("v0")) == len(sink.get("v1")) == 1000
