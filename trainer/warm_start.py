"""Head construction: draft vocabulary by token frequency, and warm starts from the target.

Owns: choosing the draft vocabulary (size by coverage of the assistant tokens), building a fresh
head for a target, and copying in every weight the target can give. Must not touch: data
loading, the training loop, files.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import torch

from adaptive_eagle.draft_head import DraftHeadConfig, Eagle3DraftHead, init_weights
from adaptive_eagle.targets import Target


@dataclass(frozen=True)
class DraftVocab:
    target_ids: torch.Tensor  # [draft_vocab] sorted target ids
    coverage: float  # share of counted tokens inside the vocab
    counted_tokens: int


def token_counts(examples: Iterable, masked_only: bool = True) -> Counter:
    counts: Counter = Counter()
    for ex in examples:
        if masked_only:
            counts.update(t for t, m in zip(ex.input_ids, ex.loss_mask) if m)
        else:
            counts.update(ex.input_ids)
    return counts


def coverage_curve(counts: Counter, sizes: Iterable[int]) -> dict[int, float]:
    total = sum(counts.values()) or 1
    ranked = [c for _, c in counts.most_common()]
    return {s: sum(ranked[:s]) / total for s in sizes}


def build_draft_vocab(counts: Counter, size: int, vocab_size: int, always: Iterable[int] = ()) -> DraftVocab:
    """The `size` most frequent tokens (plus `always`, e.g. EOS), padded with the lowest unused ids."""
    chosen: list[int] = []
    seen = set()
    for t in list(always) + [t for t, _ in counts.most_common()]:
        if t not in seen and 0 <= t < vocab_size:
            chosen.append(t), seen.add(t)
        if len(chosen) == size:
            break
    filler = (t for t in range(vocab_size) if t not in seen)
    while len(chosen) < size:
        chosen.append(next(filler))
    ids = torch.tensor(sorted(chosen), dtype=torch.long)
    total = sum(counts.values()) or 1
    covered = sum(counts[t] for t in chosen)
    return DraftVocab(ids, covered / total, total)


def size_for_coverage(counts: Counter, coverage: float, multiple: int = 1024, cap: int | None = None) -> int:
    """Smallest vocab (rounded up to `multiple`) whose most frequent tokens cover `coverage`."""
    total = sum(counts.values()) or 1
    acc = 0
    for i, (_, c) in enumerate(counts.most_common(), 1):
        acc += c
        if acc / total >= coverage:
            size = -(-i // multiple) * multiple
            return min(size, cap) if cap else size
    size = -(-len(counts) // multiple) * multiple
    return min(size, cap) if cap else size


def new_head(target: Target, vocab: DraftVocab, *, num_experts: int = 1, seed: int = 0, **overrides) -> Eagle3DraftHead:
    """A randomly initialised head shaped after the target, with its frozen embeddings."""
    cfg = DraftHeadConfig.from_target(
        target.config, draft_vocab_size=int(vocab.target_ids.numel()), aux_layer_ids=target.aux_layer_ids,
        num_experts=num_experts, **overrides,
    )
    torch.manual_seed(seed)
    head = Eagle3DraftHead(cfg)
    init_weights(head)
    head.set_draft_vocab(vocab.target_ids)
    head.embed_tokens.weight.data.copy_(target.input_embeddings().detach().float())
    return head


WARM_START_MODES = ("none", "output", "full")


@torch.no_grad()
def warm_start(head: Eagle3DraftHead, target: Target, layer: int | None = None, fc_block: int = -1,
               mode: str = "full") -> dict:
    """Copy what the target can give; returns a summary of what was copied.

    - lm_head rows: the target's output embedding at the draft-vocab ids;
    - norm: the target's final norm;
    - midlayer (hidden half of q/k/v, o_proj, post-attention norm, MLP, hidden_norm): target layer
      `layer` (default: the last layer), so the head starts as one more target layer;
    - fc: picks aux block `fc_block` (default: the deepest aux layer) as identity, others ~0.
    """
    cfg, m = head.cfg, target.model
    layers = m.model.layers
    layer = len(layers) - 1 if layer is None else layer
    src = layers[layer]
    h = cfg.hidden_size
    copied = []
    if cfg.hidden_size != target.config.hidden_size:
        raise ValueError("warm start needs the head width to equal the target's")
    if mode not in WARM_START_MODES:
        raise ValueError(f"warm start mode {mode!r} not in {WARM_START_MODES}")
    if mode == "none":
        return {"mode": mode, "copied": []}
    head.lm_head.weight.copy_(target.output_embeddings()[head.draft_to_target].float())
    head.norm.weight.copy_(m.model.norm.weight.float())
    copied += ["lm_head", "norm"]
    if mode == "output":
        return {"mode": mode, "copied": copied}
    attn, sattn = head.midlayer.self_attn, src.self_attn
    if attn.q_proj.out_features == sattn.q_proj.out_features and attn.k_proj.out_features == sattn.k_proj.out_features:
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(attn, name).weight[:, h:] = getattr(sattn, name).weight.float()
            getattr(attn, name).weight[:, :h] *= 0.5
        attn.o_proj.weight.copy_(sattn.o_proj.weight.float())
        head.midlayer.hidden_norm.weight.copy_(src.input_layernorm.weight.float())
        head.midlayer.input_layernorm.weight.copy_(src.input_layernorm.weight.float())
        copied += [f"attention<-layer{layer}"]
    head.midlayer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight.float())
    mlp = head.midlayer.mlp
    experts = list(mlp.experts) if hasattr(mlp, "experts") else [mlp]
    if all(e.gate_proj.weight.shape == src.mlp.gate_proj.weight.shape for e in experts):
        for e in experts:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(e, name).weight.copy_(getattr(src.mlp, name).weight.float())
        copied += [f"mlp<-layer{layer}"]
    n_aux = len(cfg.aux_layer_ids)
    block = fc_block % n_aux
    w = head.fc.weight
    w.mul_(0.1)
    w[:, block * cfg.target_hidden_size : (block + 1) * cfg.target_hidden_size] += torch.eye(h, cfg.target_hidden_size)
    copied += [f"fc<-identity(aux {cfg.aux_layer_ids[block]})"]
    return {"mode": mode, "from_layer": layer, "copied": copied}


def head_from_traffic(target: Target, sequences, *, coverage: float = 0.97, seed: int = 0):
    """(a new warm-started head, its DraftVocab) for a fleet that starts from plain decoding: the draft
    vocabulary is the smallest set of the traffic's most frequent tokens covering `coverage` of them."""
    from collections import Counter

    counts = Counter(t for ids in sequences for t in ids)
    vocab_size = target.config.vocab_size
    size = size_for_coverage(counts, coverage, multiple=min(1024, vocab_size), cap=vocab_size)
    vocab = build_draft_vocab(counts, size, vocab_size)
    head = new_head(target, vocab, seed=seed)
    warm_start(head, target)
    return head, vocab

