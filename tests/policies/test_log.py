"""policies.log: append-only promotions.jsonl (one fsync'd O_APPEND line per event), round trip, corrupt
lines skipped and counted, concurrent writers, follow, reads that create nothing."""

from __future__ import annotations

import json
import logging
import threading

import pytest
from pydantic import ValidationError

from policies.log import EVENTS, PromotionEvent, PromotionLog

EVIDENCE = {"gate": "offline", "tail_champion": 1.41, "tail_candidate": 1.47, "ci_low": 0.02, "ci_high": 0.09,
            "n_champion": 400, "n_candidate": 400, "domains": [{"domain": "code", "regressed": False}]}


def test_round_trip_of_every_event_kind(tmp_path):
    plog = PromotionLog(tmp_path / "promotions.jsonl")
    written = [plog.record(kind, candidate="v2", champion="v1", action="promote", reason=f"{kind}.",
                           evidence=EVIDENCE) for kind in EVENTS]
    read = plog.read()
    assert read.events == tuple(written) and read.skipped == 0
    lines = (tmp_path / "promotions.jsonl").read_text().splitlines()
    assert len(lines) == len(EVENTS) and all(json.loads(line)["event"] for line in lines)
    assert json.loads(lines[0])["evidence"]["domains"] == EVIDENCE["domains"]


def test_appends_never_rewrite_earlier_lines(tmp_path):
    path = tmp_path / "promotions.jsonl"
    plog = PromotionLog(path)
    plog.record("considered", candidate="v1")
    before = path.read_bytes()
    plog.record("rejected", candidate="v1")
    assert path.read_bytes().startswith(before) and path.read_bytes().count(b"\n") == 2


def test_corrupt_lines_are_skipped_and_counted(tmp_path, caplog):
    path = tmp_path / "promotions.jsonl"
    plog = PromotionLog(path)
    plog.record("considered", candidate="v1")
    with open(path, "ab") as f:
        f.write(b'{"event": "promoted", "cand\n')  # torn write
        f.write(b"\n")  # blank: ignored, not counted
        f.write(b'{"event": "exploded"}\n')  # JSON, but not an event
        f.write(b"\xff\xfe not utf-8\n")
    plog.record("rejected", candidate="v1")
    with caplog.at_level(logging.WARNING, logger="policies.log"):
        read = plog.read()
    assert [e.event for e in read.events] == ["considered", "rejected"]
    assert read.skipped == 3 and read.skipped_lines == (2, 4, 5)
    assert "skipped 3 corrupt line(s): 2, 4, 5" in caplog.text


def test_non_finite_numbers_are_written_as_null(tmp_path):
    plog = PromotionLog(tmp_path / "promotions.jsonl")
    plog.record("rejected", evidence={"ci_low": float("nan"), "ci_high": float("inf"), "xs": [1.0, float("-inf")]})
    ev = plog.read().events[0].evidence
    assert ev == {"ci_low": None, "ci_high": None, "xs": [1.0, None]}


def test_concurrent_writers_interleave_whole_lines(tmp_path):
    path = tmp_path / "promotions.jsonl"
    reason = "x" * 3000  # longer than one pipe buffer's atomic write

    def write(k):
        plog = PromotionLog(path, fsync=False)
        for i in range(50):
            plog.record("considered", candidate=f"w{k}-{i}", reason=reason)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    read = PromotionLog(path).read()
    assert read.skipped == 0 and len(read.events) == 200
    assert {e.candidate for e in read.events} == {f"w{k}-{i}" for k in range(4) for i in range(50)}


def test_reads_create_nothing_and_name_the_path(tmp_path):
    missing = tmp_path / "nope" / "promotions.jsonl"
    with pytest.raises(FileNotFoundError, match="does not exist.*--log"):
        PromotionLog(missing).read()
    with pytest.raises(FileNotFoundError):
        next(PromotionLog(missing).follow())
    with pytest.raises(FileNotFoundError, match="directory of the promotion log does not exist"):
        PromotionLog(missing).record("considered")
    assert not (tmp_path / "nope").exists()


def test_follow_yields_complete_lines_only(tmp_path):
    path = tmp_path / "promotions.jsonl"
    plog = PromotionLog(path)
    plog.record("considered", candidate="v1")
    seen: list = []
    gen = PromotionLog(path).follow(poll_s=0.01, stop=lambda: len(seen) >= 3)
    seen.append(next(gen))
    with open(path, "ab") as f:
        f.write(b'{"event": "canary_started", "candidate": "v1"')  # half a line: the reader must wait

    def finish_the_line():
        with open(path, "ab") as f:
            f.write(b', "reason": "r"}\nnot json\n')

    rest = threading.Timer(0.2, finish_the_line)
    rest.start()
    seen.append(next(gen))
    rest.join()
    plog.record("promoted", candidate="v1")
    seen.append(next(gen))
    assert [e.event for e in seen] == ["considered", "canary_started", "promoted"]
    assert seen[1].reason == "r"
    with pytest.raises(StopIteration):
        next(gen)


def test_events_are_validated():
    with pytest.raises(ValidationError):
        PromotionEvent(event="exploded")
    with pytest.raises(ValidationError):
        PromotionEvent(event="promoted", surprise=1)
