"""PrefixCache: the target's KV cache (and the features the head and capture need) of prompt prefixes,
kept across requests, so a session's turn k prefills only what its earlier turns did not.

Owns: blocks of prefill output keyed by the token prefix they end (a chain hash over fixed-size blocks),
LRU eviction under a byte budget, and its counts. Must not touch: models, decoding (engine.py prefills).

Exact by construction. The engine prefills every prompt in blocks of `block` tokens at absolute positions
(EngineConfig.prefill_block): block b is one target forward of its tokens over the cache of blocks 0..b-1,
whether or not anything is cached. Only whole blocks a prefill computed are stored (never tokens a verify
forward committed, never the prompt's last partial block), so a block read from here holds the bits a fresh
prefill of the same prompt computes: the same forward of the same inputs at the same shapes.

Eviction. Blocks are evicted least recently used first; a lookup touches the blocks it matched from the last
to the first, so a prefix's first blocks are used more recently than its later ones and a chain is evicted
from its end (a block whose predecessor is gone could never be matched again).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class CachedBlock:
    """One block's prefill output: per layer keys and values [1, kv_heads, block, head_dim], and the target
    features of its rows (aux [block, n_aux * H] when the prefill computed them, final [block, H] likewise)."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    aux: torch.Tensor | None
    final: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        parts = [*self.keys, *self.values, *(t for t in (self.aux, self.final) if t is not None)]
        return sum(t.numel() * t.element_size() for t in parts)


@dataclass
class PrefixCacheCounts:
    lookups: int = 0  # prefills that looked
    hits: int = 0  # prefills that found at least one block
    hit_tokens: int = 0  # prompt tokens read from the cache instead of prefilled
    miss_tokens: int = 0  # prompt tokens prefilled
    stored_blocks: int = 0
    evicted_blocks: int = 0
    refused_blocks: int = 0  # a block larger than the whole budget

    def as_dict(self) -> dict[str, int]:
        return {f"prefix_cache_{k}": v for k, v in vars(self).items()}


@dataclass
class PrefixCache:
    """Prefill blocks by the prefix they end, at most `max_bytes` of tensors (0: nothing is kept)."""

    block: int
    max_bytes: int
    counts: PrefixCacheCounts = field(default_factory=PrefixCacheCounts)

    def __post_init__(self) -> None:
        if self.block < 1:
            raise ValueError(f"prefill block must be >= 1 token, got {self.block}")
        if self.max_bytes < 0:
            raise ValueError(f"prefix cache budget must be >= 0 bytes, got {self.max_bytes}")
        self._blocks: OrderedDict[bytes, CachedBlock] = OrderedDict()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self, ids: Sequence[int]) -> list[bytes]:
        """The key of every whole block of `ids`: a hash of all tokens up to the block's end (chained)."""
        out, h = [], b""
        arr = np.asarray(ids, dtype=np.int64)
        for b in range(len(ids) // self.block):
            h = hashlib.blake2b(h + arr[b * self.block:(b + 1) * self.block].tobytes(), digest_size=16).digest()
            out.append(h)
        return out

    def lookup(self, keys: Sequence[bytes], need_aux: bool, need_final: bool) -> list[CachedBlock]:
        """The longest run of cached blocks from the first key on that holds what the request needs."""
        found = []
        for k in keys:
            b = self._blocks.get(k)
            if b is None or (need_aux and b.aux is None) or (need_final and b.final is None):
                break
            found.append(b)
        for k in reversed(keys[: len(found)]):
            self._blocks.move_to_end(k)
        return found

    def store(self, key: bytes, block: CachedBlock) -> None:
        """Keep `block` under `key` (a block already kept is only touched), evicting the least recently used."""
        if self.max_bytes == 0:
            return
        old = self._blocks.get(key)
        if old is not None and (old.aux is not None or block.aux is None) and (old.final is not None or
                                                                               block.final is None):
            self._blocks.move_to_end(key)
            return
        size = block.nbytes
        if size > self.max_bytes:
            self.counts.refused_blocks += 1
            return
        if old is not None:
            self._bytes -= old.nbytes
            del self._blocks[key]
        while self._blocks and self._bytes + size > self.max_bytes:
            _, gone = self._blocks.popitem(last=False)
            self._bytes -= gone.nbytes
            self.counts.evicted_blocks += 1
        self._blocks[key] = block
        self._bytes += size
        self.counts.stored_blocks += 1

    def clear(self) -> None:
        self._blocks.clear()
        self._bytes = 0


__all__ = ["CachedBlock", "PrefixCache", "PrefixCacheCounts"]
