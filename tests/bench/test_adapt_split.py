"""bench/adapt.py chooses on one half of the held-out records and reports on the other: the halves are disjoint,
cover the set, and do not depend on the order records come back from the store."""

from types import SimpleNamespace

from bench.adapt import split_heldout


def test_validation_and_test_halves_are_disjoint_and_stable():
    recs = [SimpleNamespace(request_id=f"code-heldout-{i}") for i in (3, 0, 5, 1, 4, 2, 10)]
    valid, test = split_heldout(recs)
    ids = lambda rs: [r.request_id.rsplit("-", 1)[1] for r in rs]  # noqa: E731
    assert ids(valid) == ["0", "2", "4", "10"] and ids(test) == ["1", "3", "5"]  # by index, not store order
    assert not set(map(id, valid)) & set(map(id, test)) and len(valid) + len(test) == len(recs)
    assert split_heldout(list(reversed(recs))) == (valid, test)
