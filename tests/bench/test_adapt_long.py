"""bench/adapt.py --workload long (bench/adapt_long.py): how the long and short figures pool verify steps, and
what the held-out session sample can settle."""


def test_long_workload_splits_buckets_at_1024_by_pooled_verify_steps():
    """long_gain_pct and short_loss_pct pool verify steps across buckets (not a mean of bucket means), and a
    side with no steps is NaN rather than a made-up 1.0."""
    import math

    from bench.adapt_long import LONG_EDGE, split_at

    buckets = [{"start": 0, "steps": 10, "accepted": 10}, {"start": 512, "steps": 30, "accepted": 0},
               {"start": 1024, "steps": 4, "accepted": 8}, {"start": 4096, "steps": 0, "accepted": 0}]
    short, long_, n_short, n_long = split_at(buckets, LONG_EDGE)
    assert (short, long_, n_short, n_long) == (1.25, 3.0, 40, 4)
    assert math.isnan(split_at(buckets[:2], LONG_EDGE)[1])


def test_long_workload_intervals_resample_whole_sessions_and_pair_the_heads():
    """The 90% intervals resample held-out sessions (a session's turns go together) and score both heads on the
    same resample: a head equal to the shipped one has a zero-width interval at 0, a better one everywhere has
    one above 0, and a head that wins on one session only has an interval that straddles 0."""
    from bench.adapt_long import LONG_EDGE, bootstrap_gain, session_of, session_sums
    from trainer.replay import RecordReplay, ReplayScore

    assert session_of("heldout-chat-17-3") == "heldout-chat-17"

    def score(acc):  # acc[s]: tokens accepted at each of session s's verify steps (one short, one long)
        return ReplayScore(tuple(RecordReplay(f"heldout-s{s}-{t}", None, (a, a), (100, LONG_EDGE + 10))
                                 for s, a in enumerate(acc) for t in range(2)))

    base = session_sums(score([1, 2, 1, 2, 1, 2]), LONG_EDGE)
    assert base["heldout-s1"] == (4, 2, 4, 2)  # two turns of session 1: (accepted, steps) short, then long
    assert bootstrap_gain(base, base, long=True) == (0.0, 0.0)
    lo, hi = bootstrap_gain(base, session_sums(score([2, 3, 2, 3, 2, 3]), LONG_EDGE), long=True)
    assert 0 < lo <= hi
    lo, hi = bootstrap_gain(base, session_sums(score([4, 2, 1, 2, 1, 1]), LONG_EDGE), long=False)
    assert lo < 0 < hi
