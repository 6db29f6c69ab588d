"""The engine's KV cache and attention change no bit: a GrowingCache holds what HF's DynamicCache holds through
prefill, verify, in-place keeps and buffer growth; GQA-in-place SDPA computes what SDPA over repeated heads does,
with a tree mask; and the process allocator is set once."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from adaptive_eagle import kv_cache
from adaptive_eagle.allocator import keep_freed_memory
from adaptive_eagle.engine import _cache_kwarg
from adaptive_eagle.kv_cache import GQA_SDPA, GrowingCache, GrowingLayer, keep_rows
from adaptive_eagle.targets import tiny_target
from adaptive_eagle.tree import build_tree, tree_attention_mask, tree_position_ids


def _forward(model, ids, cache, start, mask=None, positions=None):
    pos = torch.arange(start, start + len(ids)) if positions is None else positions
    kw = {"attention_mask": mask} if mask is not None else {}
    kw[_cache_kwarg(model)] = cache
    return model(input_ids=torch.tensor([ids]), use_cache=True, position_ids=pos[None], **kw).logits[0]


def _a_tree(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = lambda k: torch.log_softmax(torch.randn(k, vocab, generator=g), -1)  # noqa: E731
    return build_tree(logits(1)[0], lambda toks, ids, parents: logits(toks.numel()), depth=3, topk=3,
                      num_draft_tokens=9,
                      min_score=float("-inf"))


def test_growing_cache_holds_the_bits_of_dynamic_cache_through_verify_keep_and_growth(monkeypatch):
    monkeypatch.setattr(kv_cache, "MIN_ROWS", 8)  # grow several times within a short test
    target = tiny_target(seed=3, vocab_size=64, num_layers=4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (40,), generator=g).tolist()
    grow, dyn = GrowingCache(), DynamicCache()
    with torch.inference_mode():
        assert torch.equal(_forward(target.model, ids, grow, 0), _forward(target.model, ids, dyn, 0))
        n = len(ids)
        for step in range(6):  # tree verifies, each keeping a path that is not a prefix of the tree's rows
            tree = _a_tree(64, step)
            mask = tree_attention_mask(tree, n, torch.float32)
            toks = [ids[-1]] + tree.tokens.tolist()
            pos = tree_position_ids(tree, n)
            a = _forward(target.model, toks, grow, n, mask, pos)
            b = _forward(target.model, toks, dyn, n, mask, pos)
            assert torch.equal(a, b)
            leaf = int(tree.depths.argmax())
            path = [leaf]
            while int(tree.parents[path[-1]]) >= 0:
                path.append(int(tree.parents[path[-1]]))
            keep = torch.cat([torch.arange(n), n + torch.tensor([0] + sorted(i + 1 for i in path))])
            keep_rows(grow, keep)
            keep_rows(dyn, keep)
            n = keep.numel()
            for x, y in zip(grow.layers, dyn.layers):
                assert isinstance(x, GrowingLayer) and torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
        assert grow.layers[0]._kbuf.shape[-2] > 8  # it grew


def test_a_layer_assigned_from_outside_is_copied_into_its_buffer():
    layer = GrowingLayer()
    k = torch.randn(1, 2, 5, 4)
    layer.update(k, k.clone())
    layer.keys, layer.values = layer.keys[..., :3, :].clone(), layer.values[..., :3, :].clone()  # not a view
    x = torch.randn(1, 2, 2, 4)
    keys, _ = layer.update(x, x)
    assert torch.equal(keys, torch.cat([k[..., :3, :], x], -2)) and layer._in_buffer()


def test_gqa_in_place_attention_matches_repeated_heads_under_a_tree_mask():
    target = tiny_target(seed=4, vocab_size=64, num_layers=4)
    assert target.model.config._attn_implementation == GQA_SDPA
    assert target.model.config.num_key_value_heads < target.model.config.num_attention_heads
    ref = tiny_target(seed=4, vocab_size=64, num_layers=4)
    ref.model.set_attn_implementation("sdpa")
    ids = torch.randint(3, 64, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    tree = _a_tree(64, 9)
    mask = tree_attention_mask(tree, len(ids), torch.float32)
    pos = tree_position_ids(tree, len(ids))
    out = []
    with torch.inference_mode():
        for model in (target.model, ref.model):
            cache = GrowingCache()
            _forward(model, ids, cache, 0)
            out.append(_forward(model, [ids[-1]] + tree.tokens.tolist(), cache, len(ids), mask, pos))
    assert torch.equal(out[0], out[1])


def test_the_allocator_is_set_once_and_says_how():
    first = keep_freed_memory()
    assert first == keep_freed_memory()
    assert first.startswith("glibc") or first.startswith("not glibc")
