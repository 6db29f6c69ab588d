"""One verify step's proposal: the draft tree and which source proposed each of its paths.

Owns: `Proposal` (the draft head's paths, the prompt-lookup chain, the suffix index's paths with
their empirical probabilities), `restrict` (a proposal cut to part of its tree), `accept_estimates`
(each node's calibrated chance of acceptance, from the best of its sources) and `account` (what
each source got accepted: feeds the budget split and the calibration). Must not touch: models,
caches, drafting itself (drafting.py, the engine), the cost model's timing. Pure functions over a
proposal, its verify result and the objects they update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from adaptive_eagle.lookup import BudgetSplit
from adaptive_eagle.tree import DraftTree
from adaptive_eagle.verify import VerifyResult


@dataclass(frozen=True)
class Proposal:
    """One step's draft tree and which source proposed each path (for acceptance bookkeeping)."""

    tree: DraftTree
    eagle_paths: frozenset = frozenset()  # token paths the draft head proposed
    lookup: tuple[int, ...] = ()  # the prompt-lookup chain as offered (a prefix of the tree's paths)
    suffix: dict = field(default_factory=dict)  # token path -> empirical probability (suffix index)
    head_drafted: bool = False  # the head ran this step (its cost was paid even if the pruning kept none)

    def offered(self) -> dict[str, int]:
        return {"eagle": len(self.eagle_paths), "lookup": len(self.lookup), "suffix": len(self.suffix)}


def restrict(p: Proposal, tree: DraftTree) -> Proposal:
    """The proposal cut to `tree` (an ancestor-closed part of p.tree)."""
    kept = set(tree.token_paths)
    n = 0
    while n < len(p.lookup) and p.lookup[: n + 1] in kept:
        n += 1
    return Proposal(tree, p.eagle_paths & kept, p.lookup[:n], {q: v for q, v in p.suffix.items() if q in kept},
                    p.head_drafted)


def accept_estimates(calibration, p: Proposal) -> torch.Tensor:
    """[N] estimated acceptance of each node: the best of its sources' calibrated estimates (the
    draft's path probability for EAGLE nodes, the index's empirical probability for suffix
    nodes, the measured per-depth rate for the lookup chain)."""
    cal, tree = calibration, p.tree
    eagle = cal.eagle(tree.scores.exp()) if p.eagle_paths else None
    suffix_paths = [path for path in tree.token_paths if path in p.suffix]
    suffix = dict(zip(suffix_paths, cal.suffix(torch.tensor([p.suffix[q] for q in suffix_paths])).tolist())) \
        if suffix_paths else {}
    lookup = list(p.lookup)
    est = torch.zeros(tree.size)
    for i, path in enumerate(tree.token_paths):
        a = float(eagle[i]) if eagle is not None and path in p.eagle_paths else 0.0
        a = max(a, suffix.get(path, 0.0))
        if lookup[: len(path)] == list(path):
            a = max(a, cal.lookup(len(path)))
        est[i] = a
    return est


def account(calibration, split: BudgetSplit, p: Proposal, res: VerifyResult, calibrate: bool) -> None:
    """What each source got accepted: feeds the budget split and (`calibrate`: the cost-aware engine) the
    calibration of each source's estimates."""
    accepted = tuple(res.tokens[: res.accepted_drafts])
    prefixes = [accepted[:k] for k in range(1, len(accepted) + 1)]
    by_lookup = 0
    while by_lookup < min(len(p.lookup), len(accepted)) and p.lookup[by_lookup] == accepted[by_lookup]:
        by_lookup += 1
    got = {"eagle": sum(q in p.eagle_paths for q in prefixes), "lookup": by_lookup,
           "suffix": sum(q in p.suffix for q in prefixes)}
    split.update(p.offered(), got)
    if calibrate and p.tree.size:
        cal, taken = calibration, set(res.accepted_nodes)
        paths = p.tree.token_paths
        eagle_nodes = [i for i, path in enumerate(paths) if path in p.eagle_paths]
        cal.observe_eagle([math.exp(float(p.tree.scores[i])) for i in eagle_nodes],
                          [i in taken for i in eagle_nodes])
        suffix_nodes = [i for i, path in enumerate(paths) if path in p.suffix]
        cal.observe_suffix([p.suffix[paths[i]] for i in suffix_nodes], [i in taken for i in suffix_nodes])
        cal.observe_lookup(len(p.lookup), by_lookup)
