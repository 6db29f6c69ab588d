"""adaptive_eagle.suffix_index: proposals equal a brute-force count over the stored documents, trees
are well formed, memory stays bounded (LRU), tenants stay apart, warm() honours consent."""

import math
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from adaptive_eagle.suffix_index import SuffixIndex, SuffixIndexConfig, continuation_tree
from adaptive_eagle.trace import TraceRecord


def brute_force(docs: list[list[int]], context: list[int], cfg: SuffixIndexConfig, max_nodes: int):
    """{continuation prefix: empirical probability} for the longest suffix of context found in docs."""
    width = min(cfg.max_continuation, max_nodes)
    for length in range(min(cfg.max_match, len(context)), cfg.min_match - 1, -1):
        suffix = context[len(context) - length:]
        occ = [(d, j) for d in docs for j in range(length, len(d)) if d[j - length : j] == suffix]
        if occ:
            probs: dict[tuple[int, ...], float] = {}
            for d, j in occ:
                cont = tuple(d[j : j + width])
                for k in range(1, len(cont) + 1):
                    probs[cont[:k]] = probs.get(cont[:k], 0.0) + 1 / len(occ)
            return probs
    return None


def check_tree(tree) -> None:
    """Topological, depth-consistent, siblings distinct, scores = cumulative logprobs, falling."""
    n = tree.size
    assert tree.tokens.dtype == tree.parents.dtype == tree.depths.dtype == torch.long
    pairs = set()
    for i in range(n):
        p = int(tree.parents[i])
        assert -1 <= p < i
        assert int(tree.depths[i]) == (1 if p < 0 else int(tree.depths[p]) + 1)
        base = 0.0 if p < 0 else float(tree.scores[p])
        assert float(tree.scores[i]) == pytest.approx(base + float(tree.logprobs[i]), abs=1e-5)
        assert float(tree.logprobs[i]) <= 1e-6
        pairs.add((p, int(tree.tokens[i])))
    assert len(pairs) == n


docs_st = st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=6)


@settings(max_examples=150, deadline=None)
@given(docs=docs_st, context=st.lists(st.integers(0, 3), max_size=10), max_nodes=st.integers(1, 20),
       min_match=st.integers(1, 3), extra=st.integers(0, 3), max_continuation=st.integers(1, 6))
def test_probabilities_equal_brute_force(docs, context, max_nodes, min_match, extra, max_continuation):
    cfg = SuffixIndexConfig(min_match=min_match, max_match=min_match + extra, max_continuation=max_continuation,
                            max_occurrences=10_000)
    index = SuffixIndex(cfg)
    for d in docs:
        index.add(d)
    tree = index.propose(context, max_nodes)
    expected = brute_force(docs, context, cfg, max_nodes)
    if expected is None:
        assert tree is None
        return
    check_tree(tree)
    assert tree.size == min(max_nodes, len(expected))
    got = dict(zip(tree.token_paths, tree.scores.exp().tolist()))
    for path, p in got.items():
        assert p == pytest.approx(expected[path], abs=1e-6)
        if len(path) > 1:  # logprob = log(prob(node) / prob(parent))
            i = tree.token_paths.index(path)
            assert math.exp(float(tree.logprobs[i])) == pytest.approx(p / expected[path[:-1]], abs=1e-5)
    floor = min(got.values())
    assert all(p <= floor + 1e-6 for path, p in expected.items() if path not in got)  # the best nodes kept


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=7), min_size=1, max_size=12),
       max_nodes=st.integers(1, 40))
def test_continuation_tree_is_the_trie(rows, max_nodes):
    width = max(len(r) for r in rows)
    mat = np.array([r + [-1] * (width - len(r)) for r in rows], dtype=np.int64)
    tree = continuation_tree(mat, max_nodes)
    check_tree(tree)
    counts: dict[tuple[int, ...], int] = {}
    for r in rows:
        for k in range(1, len(r) + 1):
            counts[tuple(r[:k])] = counts.get(tuple(r[:k]), 0) + 1
    assert tree.size == min(max_nodes, len(counts))
    for path, score in zip(tree.token_paths, tree.scores.tolist()):
        assert score == pytest.approx(math.log(counts[path] / len(rows)), abs=1e-5)
    kept = set(tree.token_paths)
    assert all(path[:-1] in kept for path in kept if len(path) > 1)  # ancestor-closed
    # ties go to shallower nodes: a dropped node is rarer, or as frequent and no shallower
    worst = min((counts[p], -len(p)) for p in kept)
    assert all((counts[p], -len(p)) <= worst for p in counts if p not in kept)


def test_root_is_last_context_token_and_continuation_follows_suffix():
    index = SuffixIndex(SuffixIndexConfig(min_match=2, max_match=4))
    index.add([1, 2, 3, 4, 5, 6])
    index.add([9, 2, 3, 4, 7])
    index.add([2, 3, 8])
    tree = index.propose([0, 2, 3], 10)
    assert tree.token_paths == [(4,), (8,), (4, 5), (4, 7), (4, 5, 6)]
    assert tree.scores.exp().tolist() == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3])
    longest = index.propose([7, 2, 3, 4], 10)  # [2, 3, 4] beats [3, 4] and [4]
    assert longest.token_paths == [(5,), (7,), (5, 6)]
    assert index.propose([5, 1], 10) is None
    assert index.propose([3], 10) is None  # shorter than min_match
    assert index.propose(torch.tensor([0, 2, 3]), 1).token_paths == [(4,)]  # tensors work too


def test_max_occurrences_takes_the_most_recent_documents():
    index = SuffixIndex(SuffixIndexConfig(min_match=2, max_match=2, max_occurrences=2))
    for follow in (10, 11, 12, 13):
        index.add([1, 2, follow])
    tree = index.propose([1, 2], 8)
    assert sorted(tree.tokens.tolist()) == [12, 13]


def test_memory_stays_bounded_and_lru_evicts_first():
    cfg = SuffixIndexConfig(max_tokens=100, min_match=2, max_match=3)
    index = SuffixIndex(cfg)
    docs = [[1000 + 10 * i + k for k in range(10)] for i in range(12)]  # disjoint 10-token documents
    for d in docs[:10]:
        index.add(d)
    assert index.tokens_held == 100 and index.documents == 10
    assert index.propose(docs[1][:3], 4) is not None  # doc 1 used: now more recent than doc 2
    index.add(docs[10])  # evicts doc 0 (least recently used)
    index.add(docs[11])  # evicts doc 2, not doc 1
    present = [index.propose(d[:3], 4) is not None for d in docs]
    assert present == [False, True, False] + [True] * 9
    assert index.tokens_held <= 100

    rng = np.random.default_rng(0)
    for _ in range(300):
        index.add(rng.integers(0, 50, int(rng.integers(0, 40))).tolist(), tenant=f"t{int(rng.integers(3))}")
        stats = index.stats()
        assert stats.tokens_held <= cfg.max_tokens and stats.index_rows <= stats.tokens_held
    assert index.stats().memory_bytes < 128 * 1024  # arena: < 2 x (held + max(held, 4096)) tokens


def test_tenant_cap_evicts_within_the_tenant():
    index = SuffixIndex(SuffixIndexConfig(max_tokens=1000, max_tokens_per_tenant=20))
    index.add(list(range(10)), tenant="b")
    for i in range(3):
        index.add([100 + 10 * i + k for k in range(10)], tenant="a")
    assert index.propose([100, 101], 4, tenant="a") is None  # a's oldest went
    assert index.propose([0, 1], 4, tenant="b") is not None  # b untouched
    assert index.tokens_held == 30


def test_eviction_compacts_the_arena_and_stays_exact():
    cfg = SuffixIndexConfig(max_tokens=1000, min_match=2, max_match=4, max_occurrences=10_000)
    index = SuffixIndex(cfg)
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 6, 100).tolist() for _ in range(200)]  # 20k tokens: the arena compacts
    for d in docs:
        index.add(d)
    assert index.documents == 10 and index.stats().memory_bytes < 4 << 20
    for _ in range(20):
        context = rng.integers(0, 6, 6).tolist()
        tree = index.propose(context, 12)
        expected = brute_force(docs[-10:], context, cfg, 12)
        got = dict(zip(tree.token_paths, tree.scores.exp().tolist()))
        assert all(p == pytest.approx(expected[path], abs=1e-6) for path, p in got.items())


@settings(max_examples=40, deadline=None)
@given(a_docs=st.lists(st.lists(st.integers(0, 3), max_size=10), max_size=4),
       b_docs=st.lists(st.lists(st.integers(0, 3), max_size=10), max_size=4),
       context=st.lists(st.integers(0, 3), min_size=2, max_size=6))
def test_tenants_apart_when_isolated_shared_when_not(a_docs, b_docs, context):
    for isolation in (True, False):
        index = SuffixIndex(SuffixIndexConfig(tenant_isolation=isolation, max_occurrences=10_000))
        for d in a_docs:  # tenant a writes tokens 100..103, tenant b 0..3: provenance is visible
            index.add([100 + t for t in d], tenant="a")
        for d in b_docs:
            index.add(d, tenant="b")
        tree = index.propose(context, 16, tenant="b")
        cfg = index.config
        if isolation:
            expected = brute_force(b_docs, context, cfg, 16)
            assert tree is None or all(t < 100 for t in tree.tokens.tolist())
            assert index.propose([100 + t for t in context], 16, tenant="b") is None
        else:
            expected = brute_force([[100 + t for t in d] for d in a_docs] + b_docs, context, cfg, 16)
            shifted = brute_force([[100 + t for t in d] for d in a_docs] + b_docs, [100 + t for t in context],
                                  cfg, 16)
            assert (index.propose([100 + t for t in context], 16, tenant="b") is None) == (shifted is None)
        assert (tree is None) == (expected is None)


def test_forget_drops_a_tenant():
    index = SuffixIndex()
    index.add([1, 2, 3, 4], tenant="a")
    index.add([5, 6, 7, 8], tenant="b")
    assert index.forget("a") == 1
    assert index.propose([1, 2], 4, tenant="a") is None and index.documents == 1


def record(ids, mask, tenant="default", consent=True):
    return TraceRecord(request_id="r", target_fingerprint="f", head_version=None, backend="reference",
                       input_ids=tuple(ids), loss_mask=tuple(mask), tenant=tenant, capture_consent=consent)


def test_warm_adds_generated_runs_and_honours_consent():
    index = SuffixIndex(SuffixIndexConfig(tenant_isolation=True))
    records = [
        record([50, 51, 1, 2, 3, 4], [0, 0, 1, 1, 1, 1], tenant="a"),
        record([50, 9, 8, 7, 6], [0, 1, 1, 1, 1], tenant="a", consent=False),  # opted out: never indexed
        record([1, 2, 3, 60, 61, 70, 71, 72], [0, 1, 1, 0, 0, 1, 1, 1], tenant="b"),  # two turns: two documents
    ]
    assert index.warm(records) == 2  # b's first run [2, 3] is too short to hold a match and a next token
    assert index.propose([1, 2], 4, tenant="a").token_paths[0] == (3,)
    assert index.propose([50, 51], 4, tenant="a") is None  # prompts are not indexed
    assert index.propose([9, 8], 4, tenant="a") is None
    assert index.propose([70, 71], 4, tenant="b").tokens.tolist() == [72]
    assert index.propose([3, 70], 4, tenant="b") is None  # turns are never joined


@pytest.mark.parametrize("field, value, words", [
    ("max_tokens", 0, "max_tokens"), ("max_match", 0, "max_match"), ("max_match", 99, "max_match"),
    ("min_match", 0, "min_match"), ("max_continuation", 0, "max_continuation"),
    ("max_occurrences", 0, "max_occurrences"), ("max_tokens_per_tenant", 0, "max_tokens_per_tenant"),
    ("bogus", 1, "bogus"),
])
def test_bad_config_names_the_field(field, value, words):
    with pytest.raises(ValidationError, match=words):
        SuffixIndexConfig(**{field: value})


def test_min_match_above_max_match_is_refused():
    with pytest.raises(ValidationError, match="min_match .* max_match"):
        SuffixIndexConfig(min_match=5, max_match=4)
    with pytest.raises(ValueError, match="token ids"):
        SuffixIndex().add([1, -2, 3])


def test_concurrent_adds_while_proposing():
    index = SuffixIndex(SuffixIndexConfig(max_tokens=2000))
    rng = np.random.default_rng(2)
    errors = []

    def writer():
        try:
            for _ in range(300):
                index.add(rng.integers(0, 8, 30).tolist(), tenant="t")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    thread = threading.Thread(target=writer)
    thread.start()
    while thread.is_alive():
        tree = index.propose([1, 2, 3, 4], 16, tenant="t")
        if tree is not None:
            check_tree(tree)
    thread.join()
    assert not errors and index.tokens_held <= 2000
