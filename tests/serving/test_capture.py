"""CaptureSampler (low-acceptance bias, fraction, byte budget, opt-out) and TextStream (stop strings
never half emitted), table-style without a model."""

from serving.capture import CapturePolicy, CaptureSampler
from adaptive_eagle.stopping import TextStream


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_low_acceptance_is_always_kept_the_rest_sampled_within_the_budget():
    clock = Clock()
    s = CaptureSampler(CapturePolicy(fraction=0.0, low_accept_below=1.5, budget_bytes_per_s=1000, burst_s=1, seed=0),
                       clock)
    assert s.decide(1.2, "v1", 600, 100).reason == "low-accept"
    assert s.decide(3.0, "v1", 600, 100).reason == "not sampled"  # fraction 0: good requests are skipped
    assert s.decide(1.0, "none", 600, 100).reason == "not sampled"  # plain decoding is not "low acceptance"
    over = s.decide(1.1, "v1", 600, 100)
    assert not over.keep and over.reason == "over budget"  # 300 bytes left
    clock.t = 1.0  # the bucket refills at 1000 bytes/s, up to one burst
    assert s.decide(1.1, "v1", 600, 100).hidden
    assert not s.decide(1.1, "v1", 600, 100, consent=False).keep and s.stats()["opted_out"] == 1


def test_fraction_samples_about_that_share_and_tokens_only_when_asked():
    s = CaptureSampler(CapturePolicy(fraction=0.25, low_accept_below=1.0, budget_bytes_per_s=1e12, seed=1))
    kept = sum(s.decide(3.0, "v1", 10, 10).keep for _ in range(4000))
    assert 850 < kept < 1150
    t = CaptureSampler(CapturePolicy(fraction=0.0, keep_uncaptured_tokens=True, seed=0))
    d = t.decide(3.0, "v1", 10, 10)
    assert d.keep and not d.hidden and d.label == "tokens"
    assert not CaptureSampler(CapturePolicy(enabled=False)).wants_hidden(True)
    assert not CaptureSampler(CapturePolicy()).wants_hidden(False)


def test_text_stream_holds_back_a_possible_stop_string():
    words = {1: "ab", 2: "c", 3: "EN", 4: "D", 5: "x"}
    ts = TextStream(lambda ids: "".join(words[i] for i in ids), ("END",))
    out = [ts.push([i]) for i in (1, 2, 3, 4)]
    full, rest = ts.finish([1, 2, 3, 4, 5])
    assert full == "abc" and "".join(out) + rest == "abc" and "E" not in "".join(out)
