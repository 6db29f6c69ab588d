"""Feeding the head and growing its tree (shared by the engine and the trainer's acceptance replay)."""

import torch

from adaptive_eagle.draft_head import DraftKVCache
from adaptive_eagle.drafting import HeadFeed, draft_tree
from tests.adaptive_eagle.test_engine import tiny_setup


def test_head_fed_lazily_drafts_what_it_drafts_when_fed_every_step():
    target, head = tiny_setup(seed=6)
    torch.manual_seed(0)
    chunks = [(torch.randint(0, 32, (k,)).tolist(),
               torch.randn(k, 3 * target.config.hidden_size, dtype=torch.float64).to(target.device)) for k in (5, 2, 1, 3)]
    new = lambda: HeadFeed(head, DraftKVCache.empty(head.cfg, 1, 8, torch.float64, target.device))  # noqa: E731
    eager, lazy = new(), new()
    pos = 0
    for tokens, aux in chunks:
        eager.add(tokens, aux, pos)
        eager.root()
        lazy.add(tokens, aux, pos)
        pos += len(tokens)
    a, b = eager.root(), lazy.root()
    torch.testing.assert_close(a.hidden, b.hidden)
    torch.testing.assert_close(a.logprobs, b.logprobs)
    assert eager.cache.length == lazy.cache.length == pos


def test_draft_tree_leaves_the_head_cache_as_it_found_it_and_respects_its_budget():
    target, head = tiny_setup(seed=7)
    feed = HeadFeed.empty(head, 4, target.device)
    torch.manual_seed(1)
    feed.add(torch.randint(0, 32, (6,)).tolist(), torch.randn(6, 3 * target.config.hidden_size).to(head.dtype), 0)
    root = feed.root()
    keys = feed.cache.keys[:, :, :6].clone()
    tree = draft_tree(head, feed.cache, root, 6, depth=3, topk=2, budget=5, min_path_prob=0.0)
    assert feed.cache.length == 6 and torch.equal(feed.cache.keys[:, :, :6], keys)
    assert 1 <= tree.size <= 5 and int(tree.depths.max()) <= 3
    again = draft_tree(head, feed.cache, root, 6, depth=3, topk=2, budget=5, min_path_prob=0.0)
    assert torch.equal(again.tokens, tree.tokens) and torch.equal(again.parents, tree.parents)


def test_a_reader_in_another_dtype_fills_the_cache_in_its_dtype_with_what_the_head_would_compute():
    """HeadFeed.root(reader=): the same head in bf16 reads the positions (HeadBinding.prompt_head); its keys and
    values join the fp32 cache cast to fp32, its root is the head's up to bf16 rounding, and later positions are
    fed by the head itself."""
    import copy

    target, head = tiny_setup(seed=8, dtype=torch.float32)
    reader = copy.deepcopy(head).to(torch.bfloat16)
    torch.manual_seed(2)
    tokens, aux = torch.randint(0, 32, (9,)).tolist(), torch.randn(9, 3 * target.config.hidden_size)
    own, read = HeadFeed.empty(head, 4, target.device), HeadFeed.empty(head, 4, target.device)
    for feed, by in ((own, None), (read, reader)):
        feed.add(tokens[:6], aux[:6], 0)
        feed.root(4, by)
    assert read.cache.keys.dtype == torch.float32 and read.cache.length == own.cache.length == 6
    torch.testing.assert_close(read.cache.keys[:, :, :6], own.cache.keys[:, :, :6], atol=0.05, rtol=0.05)
    assert not torch.equal(read.cache.keys[:, :, :6], own.cache.keys[:, :, :6])  # it did read in bf16
    assert read.last.hidden.dtype == torch.float32
    torch.testing.assert_close(read.last.logprobs.exp(), own.last.logprobs.exp(), atol=0.02, rtol=0)
    for feed in (own, read):
        feed.add(tokens[6:], aux[6:], 6)
    a, b = own.root(), read.root()  # the head itself: fp32 over the cache the reader filled
    assert read.cache.length == 9 and b.hidden.dtype == torch.float32
    torch.testing.assert_close(b.logprobs.exp(), a.logprobs.exp(), atol=0.02, rtol=0)
