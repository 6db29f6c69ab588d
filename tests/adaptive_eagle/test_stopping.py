"""Stop conditions and incremental text (adaptive_eagle/stopping.py): the incremental stop check finds what a
whole-text search finds, text is never shown before it is final, and a step ends where plain decoding would."""

import random

import pytest

from adaptive_eagle.stopping import StopCheck, TextStream, cut_at_stop

WORDS = {i: w for i, w in enumerate(["ab", "c", "EN", "D", "x", " ", "é", "yz", "E", "ND"])}


def join(ids):
    return "".join(WORDS[i] for i in ids)


def utf8_bytes(ids):
    """A byte-level decoder: token i is one byte; unfinished characters show as U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_holds_back_a_possible_stop_string():
    ts = TextStream(join, ("END",))
    out = [ts.push([i]) for i in (0, 1, 2, 3)]
    full, rest = ts.finish([0, 1, 2, 3, 4])
    assert full == "abc" and "".join(out) + rest == "abc" and "E" not in "".join(out)
    assert ts.stop_at == 4 and ts.push([4]) == ""  # nothing after the stop string


@pytest.mark.parametrize("seed", range(40))
def test_the_incremental_search_finds_what_a_whole_text_search_finds(seed):
    rng = random.Random(seed)
    stops = tuple(rng.choice(["END", "cx", "D x", "yzE", "zz", "é "]) for _ in range(rng.randint(1, 3)))
    ids = [rng.randrange(len(WORDS)) for _ in range(30)]
    ts = TextStream(join, stops)
    shown, pos = "", 0
    while pos < len(ids) and not ts.stopped:
        k = rng.randint(1, 4)
        shown += ts.push(ids[pos:pos + k])
        pos += k
    # the first prefix of tokens whose text holds a stop string, by brute force
    want = next((i for i in range(1, len(ids) + 1) if cut_at_stop(join(ids[:i]), stops) != join(ids[:i])), None)
    assert ts.stop_at == want
    kept = ids[:want] if want else ids
    full, rest = ts.finish(kept)
    assert full == cut_at_stop(join(kept), stops) and shown + rest == full


def test_half_a_character_is_never_shown():
    ts = TextStream(utf8_bytes)
    data = "aé€😀b".encode()
    shown = [ts.push([b]) for b in data]
    assert "\ufffd" not in "".join(shown) and "".join(shown) == "aé€😀b"
    assert shown[1] == "" and shown[2] == "é"  # é is two bytes: shown once both arrived


def test_a_step_ends_where_plain_decoding_would():
    eos = {9}
    # EOS inside the step: kept, the rest dropped
    c = StopCheck(eos, 10, None)
    out = c.commit([1, 2, 9, 4])
    assert out.token_ids == (1, 2, 9) and out.finish == "stop" and c.kept == [1, 2, 9]
    # max_tokens inside the step: cut there, even when an EOS follows in the same step
    c = StopCheck(eos, 4, None)
    assert c.commit([1]).finish is None
    out = c.commit([2, 3, 4, 9])
    assert out.token_ids == (2, 3, 4) and out.finish == "length" and len(c.kept) == 4
    # a stop string completed before an EOS of the same step ends the output there
    c = StopCheck({4}, 10, TextStream(join, ("cEN",)))
    out = c.commit([0, 1, 2, 3, 4])
    assert out.token_ids == (0, 1, 2) and out.finish == "stop" and out.text == "ab"
    with pytest.raises(RuntimeError):
        c.commit([1])


def test_without_a_text_stream_only_eos_and_max_tokens_end_the_output():
    c = StopCheck(set(), 3, None)
    out = c.commit([5, 6])
    assert out.text == "" and out.finish is None
    assert c.commit([7, 8]).token_ids == (7,) and c.finish == "length"
