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


def test_a_first_run_scores_the_features_a_rerun_reads(smollm2, tmp_path, monkeypatch):
    """session_records returns a session's records as its store keeps them (the store's lossy codec), whether it
    just replayed the session or read it from the cache: a first run of the bench scores the same features as
    its reruns, and as the trainer, which reads the store."""
    import numpy as np

    import bench.adapt_long as AL
    import bench.sessions as S
    from adaptive_eagle.cli import SHIPPED_HEAD
    from bench.adapt_long import session_records

    monkeypatch.setenv("ADAPTIVE_EAGLE_CACHE", str(tmp_path))
    one = S.Session("chat-0", "chat", S.CHAT_SYSTEM, (({"role": "user", "content": "Name three rivers."},),
                                                     ({"role": "user", "content": "And three lakes?"},)))
    monkeypatch.setattr(AL.D, "load_sharegpt", lambda: [])  # the session is given: no need to read ShareGPT
    monkeypatch.setattr(S, "build_sessions", lambda *a, **k: [one])
    logs = []
    args = dict(split="heldout", n=1, max_tokens=4, min_chars=1000, max_turns=2, log=logs.append)
    fresh = session_records(smollm2, SHIPPED_HEAD, **args)
    assert any("replaying" in line for line in logs)
    logs.clear()
    cached = session_records(smollm2, SHIPPED_HEAD, **args)
    assert logs == []  # read from the cache, nothing replayed
    assert fresh and [r.input_ids for r in fresh] == [r.input_ids for r in cached]
    for a, b in zip(fresh, cached):
        assert np.array_equal(a.aux_hidden, b.aux_hidden) and np.array_equal(a.final_hidden, b.final_hidden)
