"""The target's KV cache as the reference engine keeps it, and the attention that reads it.

Owns: `GrowingCache` (a transformers `DynamicCache` whose layers write into preallocated buffers that grow
geometrically, instead of concatenating the whole cache at every forward), `keep_rows` (the accepted path
kept in place: only the rows after the first rejected one move), and `GQA_SDPA`, the attention the engine's
targets run (transformers' SDPA, except that a masked call on grouped-query heads hands the key/value heads to
SDPA as they are, `enable_gqa`, instead of copying them once per query head). Must not touch: decoding,
models' weights, the prefix cache (prefix_cache.py).

Why: at long contexts both copies cost more than the model. HF's DynamicCache concatenates every layer's
whole cache at every forward (a verify step at 2k tokens moved ~90 MB for SmolLM2), and HF's SDPA path
repeats the KV heads for any call that carries a mask, which every tree verify does (another ~280 MB a step):
a default tree+lookup step at 2k context measured 80 ms against plain decoding's 31 ms on this machine.

Exactness: neither changes a bit. A buffer view holds the same values a concatenation would; SDPA with
`enable_gqa` computes the same sums as over repeated heads (checked bit for bit in tests/adaptive_eagle/
test_kv_cache.py, plain and tree-masked).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

GQA_SDPA = "ae_gqa_sdpa"  # attn_implementation name the engine's targets run (use_gqa_attention)
MIN_ROWS = 256  # a layer's first buffer holds at least this many positions
GROWTH = 1.5  # a full buffer is replaced by one this many times larger (amortized O(1) appends)


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose `keys`/`values` are views [B, kv_heads, length, head_dim] into buffers with
    spare rows; `update` writes the new rows in place. Code that assigns `layer.keys` a slice of itself
    (crop to a prefix) keeps working; an assigned tensor that is not a view of the buffer is copied in at the
    next update."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf = self._vbuf = None

    def _in_buffer(self) -> bool:
        return self._kbuf is not None and self.keys.data_ptr() == self._kbuf.data_ptr() \
            and self.values.data_ptr() == self._vbuf.data_ptr() and self.keys.stride() == self._kbuf.stride()

    def _reserve(self, rows: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        """Buffers of at least `rows` positions holding the current keys/values in their first rows."""
        n = self.keys.shape[-2] if self.keys.numel() else 0
        if self._in_buffer() and rows <= self._kbuf.shape[-2]:
            return
        cap = max(rows, MIN_ROWS, int(self._kbuf.shape[-2] * GROWTH) if self._kbuf is not None else 0)
        kbuf = like_k.new_empty((*like_k.shape[:2], cap, like_k.shape[-1]))
        vbuf = like_v.new_empty((*like_v.shape[:2], cap, like_v.shape[-1]))
        if n:
            kbuf[..., :n, :] = self.keys
            vbuf[..., :n, :] = self.values
        self._kbuf, self._vbuf = kbuf, vbuf
        self.keys, self.values = kbuf[..., :n, :], vbuf[..., :n, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = (self.keys.shape[-2] if self.keys.numel() else 0), key_states.shape[-2]
        self._reserve(n + m, key_states, value_states)
        self._kbuf[..., n:n + m, :] = key_states
        self._vbuf[..., n:n + m, :] = value_states
        self.keys, self.values = self._kbuf[..., :n + m, :], self._vbuf[..., :n + m, :]
        return self.keys, self.values

    def keep(self, keep: torch.Tensor, first_moved: int) -> None:
        """Keep the rows `keep` (ascending; keep[i] == i for i < first_moved): only rows from first_moved on
        are copied."""
        if not self._in_buffer():
            self.keys, self.values = self.keys.index_select(-2, keep), self.values.index_select(-2, keep)
            return
        tail = keep[first_moved:]
        k, v = self._kbuf.index_select(-2, tail), self._vbuf.index_select(-2, tail)  # a copy: sources overlap
        self._kbuf[..., first_moved:keep.numel(), :] = k
        self._vbuf[..., first_moved:keep.numel(), :] = v
        self.keys, self.values = self._kbuf[..., :keep.numel(), :], self._vbuf[..., :keep.numel(), :]


class GrowingCache(DynamicCache):
    """A DynamicCache of GrowingLayers (one per layer, made on first use)."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)


def keep_rows(cache: Cache, keep: torch.Tensor) -> None:
    """Keep only the rows `keep` (ascending) of every layer's keys and values (the accepted path)."""
    n = keep.numel()
    if int(keep[-1]) == n - 1:  # a prefix: slice, no copy
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
        return
    moved = (keep != torch.arange(n, device=keep.device)).nonzero()
    first = int(moved[0, 0])
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.keep(keep, first)
        else:
            layer.keys, layer.values = layer.keys.index_select(-2, keep), layer.values.index_select(-2, keep)


def gqa_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with grouped-query heads passed to SDPA as they are (`enable_gqa`) also
    when a mask is given. query [B, heads, q, d], key/value [B, kv_heads, kv, d] -> ([B, q, heads, d], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None or key.shape[1] == query.shape[1] or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_gqa_attention(model: torch.nn.Module) -> None:
    """Run `model`'s attention through gqa_sdpa_forward where it runs SDPA (registered with transformers'
    attention and mask interfaces under GQA_SDPA; SDPA's masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(GQA_SDPA, gqa_sdpa_forward)
    AttentionMaskInterface.register(GQA_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(GQA_SDPA)
