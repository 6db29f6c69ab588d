"""Draft trees (EAGLE-2 dynamic trees): construction, position ids and the tree attention mask.

Owns: pure functions over draft trees. Must not touch: models, KV caches, sampling (the engine
passes an `expand` callable that runs the draft head; tests pass random distributions).

Vocabulary. The root is the last committed token (the bonus token of the previous step), not yet
run through the target. Each node holds one draft token; its score is the cumulative draft
log-probability of the path root → node. A tree of N nodes is stored in topological order (every
parent before its children), with parent index -1 for children of the root.

Construction (EAGLE-2): step 1 takes the top-k children of the root; each later step expands the
top-k children of each of the top-k frontier nodes (by score) and keeps the best k of those k·k
candidates as the next frontier; after `depth` steps the best `num_draft_tokens` nodes of all
candidates are kept. Scores only fall along a path, so the kept set is closed under ancestors
(ties are broken towards shallower nodes, then earlier candidates). topk = 1 gives a chain.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

# expand(tokens [k], node_ids [k], parent_ids [k]) -> log-probs [k, V] of each frontier node's
# children. Ids are candidate ids, stable for one build_tree call; parent -1 = the root.
ExpandFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [N] draft token ids
    parents: torch.Tensor  # [N] parent node index, -1 = the root
    depths: torch.Tensor  # [N] 1-based depth
    scores: torch.Tensor  # [N] cumulative draft log-prob of root -> node
    logprobs: torch.Tensor  # [N] draft log-prob of the node's token given its parent

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if self.size else 0

    def children(self, node: int) -> torch.Tensor:
        """Indices of the children of `node` (-1 = the root), in tree order."""
        return (self.parents == node).nonzero().flatten()

    @functools.cached_property
    def token_paths(self) -> list[tuple[int, ...]]:
        """Per node (tree order), the draft tokens on the path root -> node; computed once per tree."""
        paths: list[tuple[int, ...]] = []
        for tok, parent in zip(self.tokens.tolist(), self.parents.tolist()):
            paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
        return paths

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node`."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]


@dataclass(frozen=True)
class _Candidate:
    token: int
    parent: int  # candidate index, -1 = root
    depth: int
    score: float
    logprob: float


def build_tree(root_logprobs: torch.Tensor, expand: ExpandFn, depth: int, topk: int, num_draft_tokens: int,
               min_score: float = float("-inf")) -> DraftTree:
    """root_logprobs: [V] draft log-probs of the root's children. See the module docstring.

    min_score: stop expanding once no frontier node's cumulative log-prob reaches it (a path the
    draft itself finds that unlikely is rarely accepted; skipping it saves draft steps)."""
    if depth < 1 or topk < 1 or num_draft_tokens < 1:
        raise ValueError(f"depth, topk and num_draft_tokens must be >= 1 (got {depth}, {topk}, {num_draft_tokens})")
    cands: list[_Candidate] = []
    lp, tok = root_logprobs.float().topk(min(topk, root_logprobs.numel()))
    frontier = []
    for p, t in zip(lp.tolist(), tok.tolist()):
        cands.append(_Candidate(t, -1, 1, p, p))
        frontier.append(len(cands) - 1)
    for d in range(2, depth + 1):
        frontier = [i for i in frontier if cands[i].score >= min_score]
        if not frontier:
            break
        f_tokens = torch.tensor([cands[i].token for i in frontier])
        f_parents = torch.tensor([cands[i].parent for i in frontier])
        child_lp = expand(f_tokens, torch.tensor(frontier), f_parents).float()  # [k, V]
        top_lp, top_tok = child_lp.topk(min(topk, child_lp.shape[-1]), dim=-1)  # [k, topk]
        fresh = []
        for row, parent in enumerate(frontier):
            base = cands[parent].score
            for p, t in zip(top_lp[row].tolist(), top_tok[row].tolist()):
                cands.append(_Candidate(t, parent, d, base + p, p))
                fresh.append(len(cands) - 1)
        fresh.sort(key=lambda i: (-cands[i].score, i))
        frontier = fresh[:topk]
    return _select(cands, num_draft_tokens)


def _select(cands: list[_Candidate], budget: int) -> DraftTree:
    """Keep the best `budget` candidates (ancestor-closed), re-indexed in topological order."""
    ranked = sorted(range(len(cands)), key=lambda i: (-cands[i].score, cands[i].depth, i))
    kept = set()
    for i in ranked:
        if len(kept) >= budget:
            break
        chain, j = [], i
        while j >= 0 and j not in kept:  # ties can rank a child first: pull its ancestors in
            chain.append(j)
            j = cands[j].parent
        if len(kept) + len(chain) <= budget:
            kept.update(chain)
    order = sorted(kept, key=lambda i: (cands[i].depth, -cands[i].score, i))
    new_index = {old: new for new, old in enumerate(order)}
    c = [cands[i] for i in order]
    return DraftTree(
        tokens=torch.tensor([x.token for x in c], dtype=torch.long),
        parents=torch.tensor([new_index[x.parent] if x.parent >= 0 else -1 for x in c], dtype=torch.long),
        depths=torch.tensor([x.depth for x in c], dtype=torch.long),
        scores=torch.tensor([x.score for x in c], dtype=torch.float32),
        logprobs=torch.tensor([x.logprob for x in c], dtype=torch.float32),
    )


def chain_tree(tokens: list[int], logprobs: list[float] | None = None) -> DraftTree:
    """A chain (topk = 1) from explicit tokens, e.g. a prompt-lookup continuation."""
    n = len(tokens)
    lp = torch.tensor(logprobs if logprobs is not None else [0.0] * n, dtype=torch.float32)
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.arange(n, dtype=torch.long) - 1,
        depths=torch.arange(1, n + 1, dtype=torch.long),
        scores=lp.cumsum(0),
        logprobs=lp,
    )


def ancestor_matrix(tree: DraftTree) -> torch.Tensor:
    """[N, N] bool: A[i, j] is True when node j is node i or one of its ancestors."""
    n = tree.size
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(n):  # parents come first, so their rows are complete
        p = int(tree.parents[i])
        if p >= 0:
            anc[i] |= anc[p]
    return anc


def tree_position_ids(tree: DraftTree, root_position: int) -> torch.Tensor:
    """[N + 1] positions of [root, nodes...]: the root at root_position, node i at root + depth_i."""
    return torch.cat([torch.tensor([root_position]), root_position + tree.depths])


def tree_attention_mask(tree: DraftTree, prefix_len: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[1, 1, N + 1, prefix_len + N + 1] additive mask for verifying [root, nodes...] over a KV cache of
    prefix_len tokens: every row sees the whole prefix and the root; a node sees its ancestors and
    itself. 0 = visible, the dtype's minimum = hidden (a float mask: bool masks are silently wrong
    under eager attention)."""
    n = tree.size
    visible = torch.zeros(n + 1, prefix_len + n + 1, dtype=torch.bool)
    visible[:, : prefix_len + 1] = True
    visible[1:, prefix_len + 1 :] = ancestor_matrix(tree)
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def merge_trees(primary: DraftTree, extra: DraftTree, budget: int) -> DraftTree:
    """Graft `extra` (e.g. a prompt-lookup chain) onto `primary`, sharing common prefixes; nodes
    beyond `budget` are dropped from `extra` first. Both are rooted at the same token."""
    tokens, parents, depths = primary.tokens.tolist(), primary.parents.tolist(), primary.depths.tolist()
    scores, lps = primary.scores.tolist(), primary.logprobs.tolist()
    index = {(parents[i], tokens[i]): i for i in range(len(tokens))}
    remap: dict[int, int] = {}
    for j in range(extra.size):
        p = int(extra.parents[j])
        parent = remap[p] if p >= 0 else -1
        key = (parent, int(extra.tokens[j]))
        if key in index:
            remap[j] = index[key]
            continue
        if len(tokens) >= budget or (p >= 0 and p not in remap):
            break
        tokens.append(key[1]), parents.append(parent), depths.append(int(extra.depths[j]))
        scores.append(float(extra.scores[j])), lps.append(float(extra.logprobs[j]))
        index[key] = remap[j] = len(tokens) - 1
    order = sorted(range(len(tokens)), key=lambda i: (depths[i], i))
    new = {old: k for k, old in enumerate(order)}
    return DraftTree(
        tokens=torch.tensor([tokens[i] for i in order], dtype=torch.long),
        parents=torch.tensor([new[parents[i]] if parents[i] >= 0 else -1 for i in order], dtype=torch.long),
        depths=torch.tensor([depths[i] for i in order], dtype=torch.long),
        scores=torch.tensor([scores[i] for i in order], dtype=torch.float32),
        logprobs=torch.tensor([lps[i] for i in order], dtype=torch.float32),
    )


def subset_tree(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The nodes `keep` (ancestor-closed, in tree order) as a tree of their own, re-indexed."""
    new = {old: k for k, old in enumerate(keep)}
    idx = torch.tensor(keep, dtype=torch.long)
    parents = [new[int(tree.parents[i])] if int(tree.parents[i]) >= 0 else -1 for i in keep]
    return DraftTree(tree.tokens[idx], torch.tensor(parents, dtype=torch.long), tree.depths[idx],
                     tree.scores[idx], tree.logprobs[idx])
