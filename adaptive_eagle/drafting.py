"""Drafting with an EAGLE-3 head over committed positions: feeding the head and growing its tree.

Owns: `HeadRoot`, `HeadFeed` (a request's head KV cache plus committed positions not yet fed),
`head_extend` and `draft_tree` (the EAGLE-2 dynamic tree grown by the head). These are shared by
the decoding engine (which verifies the tree against the target) and the trainer's acceptance
replay (which verifies it against a recorded continuation), so both draft exactly alike. Must not
touch: the target model, verification, calibration, I/O.

Positions (see engine.py). The head at position t reads (target aux feature of t, token t+1); a
draft node at depth d sits at root_position - 1 + d in the head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from adaptive_eagle.draft_head import DraftKVCache, Eagle3DraftHead
from adaptive_eagle.tree import DraftTree, build_tree


@dataclass(frozen=True)
class HeadRoot:
    """The head's output at the newest fed position: what the next draft tree grows from."""

    hidden: torch.Tensor  # [H] pre-norm output hidden
    logprobs: torch.Tensor  # [draft_vocab] log-probs of the root's children


def head_extend(head: Eagle3DraftHead, hcache: DraftKVCache, tokens: list[int], aux: torch.Tensor,
                start_pos: int) -> HeadRoot:
    """Feed committed positions start_pos.. (aux features [n, n_aux * H] + next tokens) to the head;
    returns the last position's output hidden and draft-vocab log-probs."""
    device = hcache.keys.device
    ids = torch.tensor([tokens], device=device)
    pos = torch.arange(start_pos, start_pos + len(tokens), device=device)[None]
    last = torch.zeros(1, len(tokens), dtype=torch.bool, device=device)
    last[0, -1] = True  # only the newest position drafts: no LM head over the rest (e.g. the prompt)
    out = head.step(ids, aux[None].to(device=device, dtype=head.dtype), pos, hcache.attend_fn(), logits_rows=last)
    return HeadRoot(out.hidden[0, -1], torch.log_softmax(out.logits[-1].float(), -1))


class HeadFeed:
    """The draft head's view of one request: its KV cache plus committed positions not yet fed
    (tokens and target features), fed in one head call when the head next drafts."""

    def __init__(self, head: Eagle3DraftHead, cache: DraftKVCache) -> None:
        self.head, self.cache = head, cache
        self.tokens: list[int] = []
        self.aux: list[torch.Tensor] = []
        self.start = 0
        self.last: HeadRoot | None = None

    @classmethod
    def empty(cls, head: Eagle3DraftHead, capacity: int, device) -> "HeadFeed":
        return cls(head, DraftKVCache.empty(head.cfg, 1, capacity, head.dtype, device))

    def add(self, tokens: list[int], aux: torch.Tensor, start_pos: int) -> None:
        if not self.tokens:
            self.start = start_pos
        self.tokens += tokens
        self.aux.append(aux)

    def root(self, chunk: int | None = None, reader: Eagle3DraftHead | None = None) -> HeadRoot:
        """Feed what is pending (in head calls of at most `chunk` positions: a long prompt's attention mask
        and activations stay the size of a prefill block) and return the newest position's output.
        reader: the same head in another dtype to feed with (HeadBinding.prompt_head, faster at a prompt's many
        rows); its keys and values join the cache in the cache's dtype."""
        if self.tokens:
            aux, step = torch.cat(self.aux), chunk or len(self.tokens)
            head, cache = reader or self.head, self.cache
            if head.dtype != cache.keys.dtype:  # a cache of the reader's dtype, copied into ours below
                cache = DraftKVCache.empty(head.cfg, cache.keys.shape[0], cache.keys.shape[2], head.dtype,
                                           cache.keys.device)
                cache.append(self.cache.keys[:, :, :self.cache.length].to(head.dtype),
                             self.cache.values[:, :, :self.cache.length].to(head.dtype))
            for i in range(0, len(self.tokens), step):
                self.last = head_extend(head, cache, self.tokens[i:i + step], aux[i:i + step], self.start + i)
            if cache is not self.cache:
                n = self.cache.length
                self.cache.append(cache.keys[:, :, n:cache.length].to(self.head.dtype),
                                  cache.values[:, :, n:cache.length].to(self.head.dtype))
                self.last = HeadRoot(self.last.hidden.to(self.head.dtype), self.last.logprobs)
            self.tokens, self.aux = [], []
        return self.last


def draft_tree(head: Eagle3DraftHead, hcache: DraftKVCache, root: HeadRoot, root_pos: int, *, depth: int,
               topk: int, budget: int, min_path_prob: float) -> DraftTree:
    """Grow the dynamic tree (target-vocab tokens) with the head; leaves the head cache as it found it."""
    device = hcache.keys.device
    committed = hcache.length
    hidden: dict[int, torch.Tensor] = {-1: root.hidden}  # candidate id -> its output hidden
    ancestors: dict[int, list[int]] = {-1: []}  # candidate id -> cache rows of itself + ancestors
    d2t = head.draft_to_target

    def expand(tokens, node_ids, parent_ids):
        k = tokens.numel()
        hid = torch.stack([hidden[int(p)] for p in parent_ids])[None]  # [1, k, H]
        level = len(ancestors[int(parent_ids[0])]) + 1
        pos = torch.full((1, k), root_pos - 1 + level, device=device)
        mask = torch.full((1, 1, k, hcache.length + k), float("-inf"), device=device)
        mask[..., :committed] = 0
        for r, (n, p) in enumerate(zip(node_ids.tolist(), parent_ids.tolist())):
            rows = ancestors[p] + [hcache.length + r]
            mask[0, 0, r, rows] = 0
            ancestors[n] = rows
        out = head.step(d2t[tokens][None], hid, pos, hcache.attend_fn(mask), logits_rows=True)
        for r, n in enumerate(node_ids.tolist()):
            hidden[n] = out.hidden[0, r]
        return torch.log_softmax(out.logits[0].float(), -1)

    min_score = math.log(min_path_prob) if min_path_prob > 0 else float("-inf")
    tree = build_tree(root.logprobs, expand, depth, topk, budget, min_score)
    hcache.crop(committed)
    return DraftTree(d2t[tree.tokens], tree.parents, tree.depths, tree.scores, tree.logprobs)


__all__ = ["HeadFeed", "HeadRoot", "draft_tree", "head_extend"]
