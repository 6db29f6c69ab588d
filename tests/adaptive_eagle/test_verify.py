"""Verification: greedy path selection and sampling fidelity (statistical)."""

import math

import torch
from scipy import stats

from adaptive_eagle.tree import DraftTree, build_tree, chain_tree
from adaptive_eagle.verify import mean_accept_length, sampling_probs, verify_greedy, verify_sampling


def onehot_logits(rows):
    """rows: argmax token per verify row -> logits [R, V=8]."""
    z = torch.full((len(rows), 8), -5.0)
    for r, t in enumerate(rows):
        z[r, t] = 5.0
    return z


def test_greedy_follows_argmax_path_and_adds_bonus():
    tree = chain_tree([3, 4, 5])
    res = verify_greedy(tree, onehot_logits([3, 4, 7, 1]))  # accepts 3, 4; refuses 5; bonus 7
    assert res.accepted_nodes == (0, 1) and res.tokens == (3, 4, 7)
    assert res.rejected_token == 5 and res.last_row == 2
    full = verify_greedy(tree, onehot_logits([3, 4, 5, 6]))
    assert full.tokens == (3, 4, 5, 6) and full.rejected_token == -1
    none = verify_greedy(tree, onehot_logits([2, 0, 0, 0]))
    assert none.accepted_drafts == 0 and none.accept_length == 1 and none.tokens == (2,)
    assert res.accepted_drafts == 2 and res.accept_length == 3 and full.accept_length == 4
    assert mean_accept_length([res, full, none]) == (3 + 4 + 1) / 3  # tokens per verify step, bonus included


def test_greedy_picks_the_matching_branch():
    # root children: 1 (node0), 2 (node1); node1's child 6 (node2)
    tree = DraftTree(torch.tensor([1, 2, 6]), torch.tensor([-1, -1, 1]), torch.tensor([1, 1, 2]),
                     torch.tensor([-0.1, -0.5, -0.9]), torch.tensor([-0.1, -0.5, -0.4]))
    res = verify_greedy(tree, onehot_logits([2, 0, 6, 3]))
    assert res.accepted_nodes == (1, 2) and res.tokens == (2, 6, 3)


def test_sampling_probs_filters():
    z = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    assert torch.allclose(sampling_probs(z, 1.0).sum(), torch.tensor(1.0))
    k2 = sampling_probs(z, 1.0, top_k=2)
    assert k2[0, :2].sum() == 0 and k2[0, 2:].sum() > 0.999
    p = sampling_probs(z, 1.0, top_p=0.5)
    assert p[0, 3] > 0 and p[0, 0] == 0


def test_sampling_preserves_target_distribution():
    """Chi-square on the first emitted token and on (first, second) when the first was a tree node.

    With 40,000 draws per test and V = 6, a one-token slip (e.g. accepting with probability p/q
    instead of p, or sampling the bonus from p instead of the residual) moves some cell by
    several percent, far beyond the test's power; we require p > 1e-3 for the honest sampler."""
    torch.manual_seed(0)
    vocab, n_draws = 6, 40_000
    target_p = torch.softmax(torch.randn(8, vocab) * 1.5, dim=-1)  # rows: root + up to 7 nodes
    draft_root = torch.log_softmax(torch.randn(vocab), -1)
    g = torch.Generator().manual_seed(1)

    def expand(tokens, node_ids, parent_ids):
        return torch.log_softmax(torch.randn(tokens.numel(), vocab, generator=g), -1)

    tree = build_tree(draft_root, expand, depth=2, topk=3, num_draft_tokens=7)
    rows = target_p[: tree.size + 1]
    gen = torch.Generator().manual_seed(2)
    first = torch.zeros(vocab)
    pair = {}
    for _ in range(n_draws):
        r = verify_sampling(tree, rows, gen)
        first[r.tokens[0]] += 1
        if r.accepted_drafts >= 1 and len(r.tokens) >= 2:
            pair.setdefault(r.accepted_nodes[0], torch.zeros(vocab))[r.tokens[1]] += 1
    chi = stats.chisquare(first.numpy(), (rows[0] * n_draws).numpy())
    assert chi.pvalue > 1e-3, chi
    for node, counts in pair.items():
        expected = rows[node + 1] * counts.sum()
        keep = expected > 5
        obs, exp = counts[keep].numpy(), expected[keep].numpy()
        exp = exp * obs.sum() / exp.sum()
        assert stats.chisquare(obs, exp).pvalue > 1e-3, (node, counts, expected)
    tv = 0.5 * (first / n_draws - rows[0]).abs().sum()
    assert tv < 0.015


def test_sampling_detects_a_biased_sampler():
    """The same statistic rejects a sampler that accepts drafts too eagerly (sanity of the test's power)."""
    torch.manual_seed(0)
    vocab, n = 6, 20_000
    p = torch.softmax(torch.randn(vocab) * 1.5, -1)
    tree = chain_tree([int(p.argmin())], [math.log(0.9)])
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(vocab)
    for _ in range(n):  # biased: accept the draft with probability sqrt(p) instead of p
        x = int(tree.tokens[0])
        if torch.rand((), generator=gen) < p[x].sqrt():
            counts[x] += 1
        else:
            counts[int(torch.multinomial(p, 1, generator=gen))] += 1
    assert stats.chisquare(counts.numpy(), (p * n).numpy()).pvalue < 1e-6


def test_sampling_probs_at_extreme_settings_stay_a_distribution():
    """A temperature so small that logits / temperature overflows float32, and a top_p below every probability:
    the top token alone, never NaN."""
    from adaptive_eagle.verify import sampling_probs

    logits = torch.tensor([[1.0, 3.0, 2.0, -float("inf")], [0.5, 0.1, 0.4, 0.2]])
    for temperature, top_p in ((1e-30, 1.0), (1e-6, 1.0), (1.0, 1e-300), (1e-30, 1e-300)):
        p = sampling_probs(logits, temperature, top_p)
        assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(2))
        assert p.argmax(-1).tolist() == [1, 0] and p.max(-1).values.min() > 0.99
    torch.testing.assert_close(sampling_probs(logits, 0.7), torch.softmax(logits / 0.7, -1))
