"""Long agent sessions: real ShareGPT text of one split, alternating kinds, and a replay that carries
the whole history with the model's own answers."""

import pytest

from bench.sessions import TOOL_SYSTEM, build_sessions, replay
from trainer.data import Conversation, Message


def conv(i, n_turns=3, answer="A" * 500):
    msgs = []
    for k in range(n_turns):
        pasted = "" if k == 0 else " Here is what I have: " + "context " * 40  # later turns paste text
        msgs += [Message("user", f"question {i}.{k}: how does this part work, in detail?{pasted}"),
                 Message("assistant", f"{answer} {i}.{k}")]
    return Conversation(f"c{i}", tuple(msgs), "english")


def test_sessions_alternate_kinds_reach_their_size_and_are_deterministic():
    convs = [conv(i) for i in range(200)]
    a = build_sessions(convs, 4, min_chars=3000, answer_chars=100, seed=1)
    b = build_sessions(convs, 4, min_chars=3000, answer_chars=100, seed=1)
    assert a == b
    assert sorted(s.kind for s in a) == ["chat", "chat", "tool", "tool"]
    for s in a:
        assert s.chars() + 100 * len(s.turns) >= 3000 or len(s.turns) == 10
        if s.kind == "tool":
            assert s.system == TOOL_SYSTEM
            assert all([m["role"] for m in t] == ["user", "tool"] for t in s.turns)
            assert all(t[1]["content"].startswith('search("') for t in s.turns)
        else:
            assert all([m["role"] for m in t] == ["user"] for t in s.turns)
    texts = [m["content"] for s in a for t in s.turns for m in t if m["role"] == "user"]
    assert len(texts) == len(set(texts))  # no user turn is used twice


def test_a_larger_build_keeps_the_smaller_ones_sessions():
    """bench/adapt.py --heldout-from K scores the sessions a build of K + n holds past its first K: those must
    be exactly the sessions a build of K never holds (the reported ones), whatever the shuffle."""
    convs = [conv(i) for i in range(200)]
    small = build_sessions(convs, 4, min_chars=3000, answer_chars=100)
    large = build_sessions(convs, 8, min_chars=3000, answer_chars=100)
    first = [s for s in large if s.index < 4]
    assert sorted(first, key=lambda s: s.id) == sorted(small, key=lambda s: s.id)
    later = [s for s in large if s.index >= 4]
    texts = lambda sessions: {m["content"] for s in sessions for t in s.turns for m in t}  # noqa: E731
    assert len(later) == 4 and not texts(later) & texts(small)


def test_too_little_text_is_a_clear_error():
    with pytest.raises(ValueError, match="sessions of 50000 characters"):
        build_sessions([conv(i) for i in range(3)], 2, min_chars=50000, max_turns=1000)


def test_replay_sends_the_history_with_the_models_own_answers_and_stops_at_the_context():
    s = build_sessions([conv(i) for i in range(50)], 2, min_chars=2000, answer_chars=50)[0]
    seen = []

    def generate(messages, k):
        seen.append(messages)
        return f"my answer {k}"

    sent = replay(s, generate)
    assert len(sent) == len(s.turns) and sent == seen
    for k, request in enumerate(sent):
        assert request[0]["role"] == "system"
        answers = [m["content"] for m in request if m["role"] == "assistant"]
        assert answers == [f"my answer {i}" for i in range(k)]  # the model's own, in order
        assert request[-len(s.turns[k]):] == list(s.turns[k])
    # a context limit ends the session before the request that would not fit
    short = replay(s, generate, fits=lambda m: sum(len(x["content"]) for x in m) < 600)
    assert 0 < len(short) < len(s.turns)
    # a failed answer (None) ends it after that turn
    assert len(replay(s, lambda m, k: None)) == 1
