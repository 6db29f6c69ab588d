"""Replay buffer: per-domain reservoirs (uniform over everything a domain produced, whichever cap
binds), caps, mixing ratio, checkpoint round trips (with and without priority keys)."""

import collections
import math
import random

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
    other.restore([(d, x, 1) for d, x in buf.items()], buf.seen(), buf.priorities())
    assert other.items() == buf.items() and other.seen() == {"a": 10} and other.bytes == 3
    assert other.priorities() == buf.priorities()


# ---- uniform over history, whichever cap binds ----------------------------------------------------
N_STREAM = 20_000
SEEDS = range(8)
CHI2_9DOF_999 = 27.877  # chi-square, 9 degrees of freedom: P(X > 27.877) = 0.001


def _stream(buf: ReplayBuffer, seed: int, n: int = N_STREAM, start: int = 0, domains=("code",)) -> dict[int, int]:
    """Offer records numbered start.. in arrival order, sizes uniform in [100, 1900] bytes; returns the sizes."""
    rng = random.Random(1000 + seed)
    sizes = {i: rng.randint(100, 1900) for i in range(start, start + n)}
    for i, size in sizes.items():
        buf.add(i, domains[i % len(domains)], size)
    return sizes


def _held_by_decile(held: list[int], n: int = N_STREAM) -> list[int]:
    counts = [0] * 10
    for i in held:
        counts[i * 10 // n] += 1
    return counts


def _assert_uniform_over_history(held: list[int], n: int = N_STREAM) -> tuple[int, int, float]:
    """Under a uniform reservoir each held record is from the first half with p = 1/2 (within one run the
    draws are without replacement, so a binomial bound is conservative): 4 sigma. The ten deciles of
    history hold alike: chi-square at P = 0.001. Returns (first half, held, chi-square)."""
    total, first = len(held), sum(i < n // 2 for i in held)
    assert abs(first - total / 2) <= 4 * math.sqrt(total / 4), (first, total)
    deciles = _held_by_decile(held, n)
    chi2 = sum((c - total / 10) ** 2 / (total / 10) for c in deciles)
    assert chi2 < CHI2_9DOF_999, (deciles, chi2)
    return first, total, chi2


def test_the_byte_cap_binding_keeps_a_uniform_sample_of_history():
    held: list[int] = []
    for seed in SEEDS:
        buf = ReplayBuffer(per_domain=100_000, max_bytes=200_000, seed=seed)  # ~200 records of ~1000 bytes
        _stream(buf, seed)
        assert buf.bytes <= 200_000 and len(buf) > 150
        held += [x for _, x in buf.items()]
    _assert_uniform_over_history(held)


def test_the_count_cap_binding_keeps_a_uniform_sample_of_history():
    held: list[int] = []
    for seed in SEEDS:
        buf = ReplayBuffer(per_domain=200, seed=seed)
        _stream(buf, seed)
        assert len(buf) == 200
        held += [x for _, x in buf.items()]
    _assert_uniform_over_history(held)


def test_domains_sharing_a_byte_cap_each_keep_a_uniform_sample_of_their_history():
    held: dict[str, list[int]] = {"code": [], "english": [], "math": []}
    for seed in SEEDS:
        buf = ReplayBuffer(per_domain=100_000, max_bytes=300_000, seed=seed)
        _stream(buf, seed, domains=("code", "english", "english", "math", "math", "math"))
        assert buf.bytes <= 300_000
        for d, x in buf.items():
            held[d].append(x)
    for d, xs in held.items():
        assert len(xs) > 8 * 50, d
        _assert_uniform_over_history(xs)


def test_the_caps_hold_after_every_add_even_for_records_larger_than_the_byte_cap():
    rng = random.Random(7)
    buf = ReplayBuffer(per_domain=30, max_bytes=5_000, seed=7)
    for i in range(3000):
        size = rng.choice([0, 10, 300, 1200, 6000])
        kept = buf.add(i, rng.choice("abc"), size)
        assert buf.bytes <= 5_000 and max(buf.domains().values()) <= 30
        assert kept == any(x == i for _, x in buf.items()) and not (kept and size > 5_000)
    assert sum(buf.seen().values()) == 3000


def test_a_restored_buffer_goes_on_sampling_uniformly():
    held: list[int] = []
    for seed in SEEDS:
        buf = ReplayBuffer(per_domain=100_000, max_bytes=200_000, seed=seed)
        sizes = _stream(buf, seed, n=N_STREAM // 2)
        again = ReplayBuffer(per_domain=100_000, max_bytes=200_000, seed=100 + seed)
        again.restore([(d, x, sizes[x]) for d, x in buf.items()], buf.seen(), buf.priorities())
        assert again.items() == buf.items() and again.bytes == buf.bytes
        _stream(again, seed + 50, n=N_STREAM // 2, start=N_STREAM // 2)
        held += [x for _, x in again.items()]
    _assert_uniform_over_history(held)


def test_a_checkpoint_without_keys_still_loads_and_goes_on_sampling_uniformly():
    """Old checkpoints carry items and seen counts only: keys are drawn from their law given those."""
    held: list[int] = []
    for seed in SEEDS:
        buf = ReplayBuffer(per_domain=200, seed=seed)
        _stream(buf, seed, n=N_STREAM // 2)
        old = ReplayBuffer(per_domain=200, seed=100 + seed)
        old.restore([(d, x, 1000) for d, x in buf.items()], buf.seen())
        assert sorted(old.items()) == sorted(buf.items()) and old.seen() == buf.seen() == {"code": N_STREAM // 2}
        p = old.priorities()
        assert 0 < p["thresholds"]["code"] < 1 and max(p["keys"]) < p["thresholds"]["code"]
        _stream(old, seed + 50, n=N_STREAM // 2, start=N_STREAM // 2)
        held += [x for _, x in old.items()]
    _assert_uniform_over_history(held)


def test_restore_refuses_keys_that_do_not_match_the_items():
    buf = ReplayBuffer(per_domain=3, seed=0)
    with pytest.raises(ValueError, match="2 keys for 1 items"):
        buf.restore([("a", b"x", 1)], {"a": 5}, {"keys": [0.1, 0.2], "thresholds": {"a": 0.5}})
    with pytest.raises(ValueError, match="outside"):
        buf.restore([("a", b"x", 1)], {"a": 5}, {"keys": [0.7], "thresholds": {"a": 0.5}})


def test_restarts_draw_new_keys_so_a_checkpoint_of_a_restarted_buffer_restores_again():
    """Found by a cluster run: the trainer's buffer restarts with the same seed, so a restarted process drew
    the keys it already held; an eviction of one twin left the other at the threshold, the next restart's
    restore raised, and Ray restarted the trainer into the same error for good."""
    buf = ReplayBuffer(per_domain=8, seed=0)
    for i in range(20):
        buf.add(f"x{i}".encode(), None, 10)
    for restart in range(6):
        again = ReplayBuffer(per_domain=8, seed=0)  # a new process, the same config
        assert again.restore([(d, x, len(x)) for d, x in buf.items()], buf.seen(), buf.priorities()) == 0
        for i in range(20):
            again.add(f"r{restart}-{i}".encode(), None, 10)
        keys = again.priorities()["keys"]
        assert len(keys) == len(set(keys)), f"restart {restart}: a key drawn twice"
        buf = again


def test_a_held_key_at_its_threshold_is_dropped_and_one_above_it_refused():
    """A checkpoint written before the reseed may hold a key equal to its domain's threshold: that record is
    dropped (counted), the rest restored; a key above the threshold is a corrupt checkpoint, refused."""
    buf = ReplayBuffer(per_domain=3, seed=0)
    assert buf.restore([("a", b"x", 1), ("a", b"y", 1)], {"a": 9},
                       {"keys": [0.1, 0.5], "thresholds": {"a": 0.5}}) == 1
    assert [x for _, x in buf.items()] == [b"x"]
    with pytest.raises(ValueError, match="outside"):
        buf.restore([("a", b"x", 1)], {"a": 5}, {"keys": [1.5], "thresholds": {"a": 1.0}})
    assert [x for _, x in buf.items()] == [b"x"]  # a refused checkpoint leaves the buffer as it was
