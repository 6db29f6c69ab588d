"""Verification: which drafted tokens the target accepts, losslessly.

Vocabulary.
  draft        a token proposed by the draft head (a node of the DraftTree);
  target       the model whose output distribution must be preserved exactly;
  accepted     draft tokens the target agrees with, along one root-to-node path;
  bonus token  the one token the target itself emits after the last accepted node (always one);
  accepted drafts  the number of accepted draft tokens in a step (0..depth): `VerifyResult.accepted_drafts`;
  accept length  the tokens a step yields, accepted drafts + the bonus token (1..depth + 1):
               `VerifyResult.accept_length`; a request's (or a head's) accept length is its mean over
               verify steps, `mean_accept_length` (1.0 = plain decoding speed). Serving, the policy and
               the trainer's replay use "accept length" in this sense only. (`VerifyStep.accept_length`
               in a stored trace is a step's accepted drafts: a persisted field kept under its old name.)

Rows of the target's verify output: row 0 is the root (the last committed token), row i + 1 is
tree node i; row r's distribution is the target's next-token distribution after that node's path.

Greedy: follow the child whose token equals the target's argmax, as long as one exists.
Sampling: multi-round rejection sampling over each node's children. EAGLE-2 picks children
deterministically (top-k), so each child is a point-mass draft: child x is accepted with
probability p_res(x), where p_res starts as the target distribution p and, after each refused
child, becomes p_res with that token removed and renormalised; when every child is refused the
bonus token is drawn from p_res. The emitted token is therefore distributed exactly as p.
Must not touch: models, caches. Pure functions over tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from adaptive_eagle.tree import DraftTree


@dataclass(frozen=True)
class VerifyResult:
    accepted_nodes: tuple[int, ...]  # node indices along the accepted path (root excluded)
    tokens: tuple[int, ...]  # accepted draft tokens followed by the bonus token
    rejected_token: int = -1  # first refused draft token on the final node (-1: none refused)
    rejected_draft_prob: float = math.nan
    rejected_target_prob: float = math.nan

    @property
    def accepted_drafts(self) -> int:
        """Draft tokens the target accepted (0..depth)."""
        return len(self.accepted_nodes)

    @property
    def accept_length(self) -> int:
        """Tokens this step yields: the accepted drafts and the bonus token (1..depth + 1)."""
        return len(self.tokens)

    @property
    def bonus_token(self) -> int:
        return self.tokens[-1]

    @property
    def last_row(self) -> int:
        """Verify-output row of the last accepted node (0 = the root)."""
        return self.accepted_nodes[-1] + 1 if self.accepted_nodes else 0


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """[R, V] logits -> the target's sampling distribution (temperature > 0, then top-k, then top-p)."""
    if temperature <= 0:
        raise ValueError("sampling_probs needs temperature > 0; use verify_greedy for greedy decoding")
    z = logits.float()
    z = (z - z.amax(-1, keepdim=True)) / temperature  # shifted first: a tiny temperature gives -inf, never inf - inf
    if top_k and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # keep the smallest prefix reaching top_p
        keep[..., 0] = True  # and the top token always (a top_p below float32's smallest value compares as 0)
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _children_lists(tree: DraftTree) -> list[list[int]]:
    """children[r] for verify rows r (0 = root, i + 1 = node i), in tree order."""
    kids: list[list[int]] = [[] for _ in range(tree.size + 1)]
    for i, p in enumerate(tree.parents.tolist()):
        kids[p + 1].append(i)
    return kids


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> VerifyResult:
    """target_logits: [N + 1, V]. Longest path whose tokens equal the target's argmax."""
    argmax = target_logits.argmax(-1).tolist()
    kids = _children_lists(tree)
    tokens = tree.tokens.tolist()
    path: list[int] = []
    row = 0
    while True:
        nxt = next((c for c in kids[row] if tokens[c] == argmax[row]), None)
        if nxt is None:
            break
        path.append(nxt)
        row = nxt + 1
    rejected = next((c for c in kids[row]), None)  # the best-scored child the target refused
    rej = _rejection_info(tree, rejected, torch.softmax(target_logits[row].float(), -1))
    return VerifyResult(tuple(path), tuple(tokens[c] for c in path) + (argmax[row],), *rej)


def verify_sampling(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None = None) -> VerifyResult:
    """target_probs: [N + 1, V] the target's sampling distribution per verify row. Runs on the CPU
    (a CPU generator drives it, so results are reproducible on any device)."""
    target_probs = target_probs.detach().cpu()
    kids = _children_lists(tree)
    tokens = tree.tokens.tolist()
    path: list[int] = []
    row = 0
    first_rejected: int | None = None
    while True:
        p_res = target_probs[row].double().clone()
        accepted = None
        rejected_here = None
        for c in kids[row]:
            x = tokens[c]
            px = float(p_res[x])
            if px > 0 and float(torch.rand((), generator=generator, dtype=torch.float64)) < px:
                accepted = c
                break
            rejected_here = c if rejected_here is None else rejected_here
            p_res[x] = 0.0
            total = float(p_res.sum())
            if total <= 0:  # numerically everything was drafted and refused; fall back to p
                p_res = target_probs[row].double().clone()
                break
            p_res /= total
        if accepted is None:
            first_rejected = rejected_here
            bonus = int(torch.multinomial(p_res.float(), 1, generator=generator))
            break
        path.append(accepted)
        row = accepted + 1
    rej = _rejection_info(tree, first_rejected, target_probs[row])
    return VerifyResult(tuple(path), tuple(tokens[c] for c in path) + (bonus,), *rej)


def _rejection_info(tree: DraftTree, node: int | None, target_row_probs: torch.Tensor) -> tuple[int, float, float]:
    if node is None:
        return -1, math.nan, math.nan
    tok = int(tree.tokens[node])
    return tok, float(math.exp(float(tree.logprobs[node]))), float(target_row_probs[tok])


def mean_accept_length(results) -> float:
    """The accept length of a run of verify steps: mean tokens per step (accepted drafts + bonus) over
    VerifyResults (0.0 when there are none)."""
    results = list(results)
    return sum(r.accept_length for r in results) / max(1, len(results))
