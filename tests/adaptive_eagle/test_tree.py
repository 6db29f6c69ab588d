"""Tree invariants (property tests) for adaptive_eagle.tree."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive_eagle.tree import (
    ancestor_matrix,
    build_tree,
    chain_tree,
    merge_trees,
    tree_attention_mask,
    tree_position_ids,
)


def random_expand(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)

    def expand(tokens, node_ids, parent_ids):
        return torch.log_softmax(torch.randn(tokens.numel(), vocab, generator=g) * 3, dim=-1)

    return expand


def make_tree(vocab, depth, topk, budget, seed):
    g = torch.Generator().manual_seed(seed + 1)
    root = torch.log_softmax(torch.randn(vocab, generator=g) * 3, dim=-1)
    return build_tree(root, random_expand(vocab, seed), depth, topk, budget)


tree_args = dict(
    vocab=st.integers(2, 40), depth=st.integers(1, 6), topk=st.integers(1, 5),
    budget=st.integers(1, 40), seed=st.integers(0, 10_000),
)


@settings(max_examples=60, deadline=None)
@given(**tree_args)
def test_tree_invariants(vocab, depth, topk, budget, seed):
    tree = make_tree(vocab, depth, topk, budget, seed)
    n = tree.size
    assert 1 <= n <= budget
    assert tree.max_depth <= depth
    for i in range(n):
        p = int(tree.parents[i])
        assert p < i  # parents before children
        assert int(tree.depths[i]) == (1 if p < 0 else int(tree.depths[p]) + 1)
        if p >= 0:
            assert float(tree.scores[i]) <= float(tree.scores[p]) + 1e-6  # scores only fall
    # siblings carry distinct tokens
    pairs = {(int(p), int(t)) for p, t in zip(tree.parents, tree.tokens)}
    assert len(pairs) == n
    pos = tree_position_ids(tree, root_position=17)
    assert pos[0] == 17 and torch.equal(pos[1:], 17 + tree.depths)
    mask = tree_attention_mask(tree, prefix_len=5)[0, 0]
    assert mask.shape == (n + 1, 5 + n + 1)
    visible = mask == 0
    assert visible[:, :6].all()  # the prefix and the root are visible to every row
    assert visible[0, 6:].sum() == 0  # the root sees no draft node
    for i in range(n):
        expected = set(tree.path_to(i))
        seen = {j for j in range(n) if visible[i + 1, 6 + j]}
        assert seen == expected  # a node sees exactly its ancestors and itself


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(2, 40), depth=st.integers(1, 6), seed=st.integers(0, 10_000))
def test_topk_one_is_the_greedy_chain(vocab, depth, seed):
    tree = make_tree(vocab, depth, 1, depth, seed)
    assert torch.equal(tree.parents, torch.arange(tree.size) - 1)
    assert tree.size == depth
    # it follows the argmax of each step's distribution
    g = torch.Generator().manual_seed(seed + 1)
    root = torch.log_softmax(torch.randn(vocab, generator=g) * 3, dim=-1)
    assert int(tree.tokens[0]) == int(root.argmax())


def test_best_nodes_are_kept():
    # root: a (p .6), b (.4); children of a: c (.9), d (.1); of b: e (.5), f (.5)
    root = torch.log(torch.tensor([0.6, 0.4, 1e-9, 1e-9, 1e-9, 1e-9]))
    table = {0: [1e-9, 1e-9, 0.9, 0.1, 1e-9, 1e-9], 1: [1e-9, 1e-9, 1e-9, 1e-9, 0.5, 0.5]}

    def expand(tokens, node_ids, parent_ids):
        return torch.log(torch.tensor([table[int(t)] for t in tokens]))

    tree = build_tree(root, expand, depth=2, topk=2, num_draft_tokens=3)
    got = {(int(t), int(tree.tokens[p]) if p >= 0 else None) for t, p in zip(tree.tokens, tree.parents)}
    assert got == {(0, None), (1, None), (2, 0)}  # a .6, b .4, a->c .54 beat b->e .2


def test_ancestor_matrix_and_chain():
    tree = chain_tree([5, 6, 7])
    anc = ancestor_matrix(tree)
    assert torch.equal(anc, torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))


def test_merge_shares_prefixes_and_respects_budget():
    primary = chain_tree([1, 2, 3])
    extra = chain_tree([1, 2, 9, 10])
    merged = merge_trees(primary, extra, budget=5)
    assert merged.size == 5
    paths = [[int(merged.tokens[j]) for j in merged.path_to(i)] for i in range(merged.size)]
    assert [1, 2, 9, 10] in paths and [1, 2, 3] in paths
    small = merge_trees(primary, extra, budget=3)
    assert small.size == 3


def test_mask_is_float_with_large_negative():
    tree = chain_tree([4, 5])
    m = tree_attention_mask(tree, 2, torch.bfloat16)
    assert m.dtype == torch.bfloat16 and float(m.min()) < -1e30


def test_token_paths_follow_parents():
    tree = chain_tree([4, 5, 6])
    assert tree.token_paths == [(4,), (4, 5), (4, 5, 6)]
    assert all(list(p) == [int(tree.tokens[j]) for j in tree.path_to(i)] for i, p in enumerate(tree.token_paths))
