"""Which snapshot's test-then-train evidence closes when too many gather at once: the older one whose rows lead
the champion least, so a clearly better snapshot keeps gathering the evidence the sequential gate needs."""

from adaptive_eagle.evidence import read_evidence
from trainer import prequential
from trainer.prequential import EvidenceBook, lead
from trainer.replay import TreeParams


def _book(tmp_path, monkeypatch, max_pending=2) -> EvidenceBook:
    monkeypatch.setattr(prequential, "replay_ready", lambda head, adopt=False: head)  # no head to make ready here
    return EvidenceBook(tmp_path, TreeParams(), max_pending=max_pending, max_records=100)


def _rows(book: EvidenceBook, version: str, pairs) -> None:
    snap = next(s for s in book.open if s.version == version)
    for i, (champion, candidate) in enumerate(pairs):
        snap.evidence.add(f"{version}-r{i}", "code", champion, candidate, True, None)


def test_a_newer_snapshot_closes_the_older_one_that_leads_the_champion_least(tmp_path, monkeypatch):
    book = _book(tmp_path, monkeypatch)
    book.add("s1", object(), "v1", {})
    _rows(book, "s1", [(1.3, 2.0)] * 6)  # a clearly better snapshot: +0.7 a record
    book.add("s2", object(), "v1", {})
    _rows(book, "s2", [(1.3, 1.4)] * 3)
    book.add("s3", object(), "v1", {})  # three gather: s2 leads less than s1, so s2 closes, s1 keeps gathering
    assert [s.version for s in book.open] == ["s1", "s3"]
    closed = read_evidence(tmp_path, "s2")
    assert not closed.open and "lead the champion least" in closed.closed_reason and "+0.100" in closed.closed_reason
    _rows(book, "s3", [(1.3, 2.5)] * 2)  # the newest overtakes: the next snapshot closes s1
    book.add("s4", object(), "v1", {})
    assert [s.version for s in book.open] == ["s3", "s4"] and not read_evidence(tmp_path, "s1").open


def test_among_equals_the_oldest_closes_and_a_snapshot_without_rows_leads_by_nothing(tmp_path, monkeypatch):
    book = _book(tmp_path, monkeypatch, max_pending=3)
    for v in ("a", "b", "c"):
        book.add(v, object(), "v1", {})
    _rows(book, "b", [(1.5, 1.2)])  # behind the champion: closes before the two without rows
    book.add("d", object(), "v1", {})
    assert [s.version for s in book.open] == ["a", "c", "d"]
    book.add("e", object(), "v1", {})
    assert [s.version for s in book.open] == ["c", "d", "e"]  # a and c both lead by 0: the oldest closes
    assert abs(lead(read_evidence(tmp_path, "b")) + 0.3) < 1e-9
