"""Replay buffer: per-domain reservoirs (uniform over everything a domain produced), caps, mixing ratio."""

import collections

import pytest

from trainer.buffer import ReplayBuffer, replay_rows


def test_reservoir_keeps_every_record_with_the_same_chance():
    kept = collections.Counter()
    for seed in range(300):
        buf = ReplayBuffer(per_domain=10, seed=seed)
        for i in range(100):
            buf.add(i, "code")
        kept.update(x for _, x in buf.items())
    # each of 100 items is kept with probability 10/100: 30 of 300 runs on average
    early, late = sum(kept[i] for i in range(50)), sum(kept[i] for i in range(50, 100))
    assert abs(early - late) < 0.15 * (early + late)
    assert max(kept.values()) < 60 and min(kept.values()) > 10


def test_domains_are_bounded_separately_and_rehearsed_alike():
    buf = ReplayBuffer(per_domain=8, seed=0)
    for i in range(1000):
        buf.add(("english", i), "english")
    for i in range(5):
        buf.add(("code", i), "code")
    assert buf.domains() == {"code": 5, "english": 8} and buf.seen() == {"code": 5, "english": 1000}
    draws = collections.Counter(d for d, _ in buf.sample(4000))
    assert abs(draws["code"] - 2000) < 200  # a rare domain is not drowned by a frequent one
    heavy = collections.Counter(d for d, _ in buf.sample(4000, {"code": 3.0}))
    assert abs(heavy["code"] - 3000) < 200


def test_byte_cap_evicts_from_the_largest_domain():
    buf = ReplayBuffer(per_domain=100, max_bytes=1000, seed=0)
    for i in range(20):
        buf.add(i, "big", size=100)
    buf.add("x", "small", size=50)
    assert buf.bytes <= 1000 and buf.domains()["small"] == 1


def test_replay_rows_keep_the_ratio():
    assert replay_rows(6, 0.25) == 2 and replay_rows(4, 0.5) == 4 and replay_rows(0, 0.5) == 0
    assert replay_rows(10, 0.0) == 0
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        replay_rows(3, 1.0)


def test_restore_round_trip():
    buf = ReplayBuffer(per_domain=3, seed=0)
    for i in range(10):
        buf.add(bytes([i]), "a", 1)
    other = ReplayBuffer(per_domain=3, seed=0)
    other.restore([(d, x, 1) for d, x in buf.items()], buf.seen())
    assert other.items() == buf.items() and other.seen() == {"a": 10} and other.bytes == 3
