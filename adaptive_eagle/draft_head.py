"""EAGLE-3 draft head: the one home of the draft-head math.

Owns: the head's config, its modules (in SGLang's ``LlamaForCausalLMEagle3`` layout, parameter
names included), the reduced draft vocabulary (``d2t`` / ``t2d``), the optional MoE-routed MLP and a
small KV cache for drafting. Must not touch: files, targets, data, training loops. Training
(``trainer/ttt.py``) and serving import this module; neither forks it.

Layout (state-dict keys equal the checkpoint keys SGLang loads)::

    embed_tokens.weight            [vocab, H]            from the target, frozen, not saved
    fc.weight                      [H, 3 * H_target]     no bias
    midlayer.input_layernorm       norm of the token embedding
    midlayer.hidden_norm           norm of the hidden stream
    midlayer.self_attn.{q,k,v}_proj  read cat(embed, hidden)  [.., 2H]
    midlayer.self_attn.o_proj
    midlayer.post_attention_layernorm
    midlayer.mlp.{gate,up,down}_proj        (dense; MoE: mlp.router, mlp.experts.<e>.*)
    norm.weight
    lm_head.weight                 [draft_vocab, H]
    d2t  int64 [draft_vocab]       target_id = draft_id + d2t[draft_id]
    t2d  bool  [vocab]             True where the target token is in the draft vocab

One step of the head: ``hidden`` (width 3·H_target from the target's aux layers, or width H from
the head's own previous step) goes through ``fc`` only when it has width 3·H_target; the layer's
residual is that hidden stream; the step returns the pre-norm output (hidden + residual), which is
what the next draft step is fed, and logits over the draft vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# attend(q, k, v) -> attention output. q: [B, heads, T, head_dim]; k, v: [B, kv_heads, T, head_dim],
# rotary already applied. The caller decides which keys each query sees (KV cache, TTT pattern).
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def check_aux_layer_ids(ids, field: str = "aux_layer_ids") -> tuple[int, ...]:
    """`ids` as ints when strictly ascending and unique, else ValueError naming `field` and the rule.

    The head's fc reads its aux blocks in list order, while serving stacks capture in layer order
    (SGLang walks its layers, vLLM tests membership), so a repeated or out-of-order id would feed
    fc blocks in an order the head was not trained on (or fewer blocks than fc expects).
    """
    ids = tuple(int(k) for k in ids)
    if any(a >= b for a, b in zip(ids, ids[1:])):
        raise ValueError(f"{field} {list(ids)} must be strictly ascending and unique (serving stacks capture aux "
                         "layers in layer order; fc reads its blocks in list order)")
    return ids


@dataclass(frozen=True)
class DraftHeadConfig:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # inputs of these target layers (see targets.py for the convention)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    num_experts: int = 1  # 1 = dense MLP; >1 = MoE-routed MLP
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None  # per-expert width; default intermediate_size // num_experts
    router_aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        if self.draft_vocab_size > self.vocab_size or self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} not in [1, {self.vocab_size}]")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts < 1 or not 1 <= self.num_experts_per_tok:
            raise ValueError("num_experts and num_experts_per_tok must be >= 1")
        object.__setattr__(self, "aux_layer_ids", check_aux_layer_ids(self.aux_layer_ids))
        if len(self.aux_layer_ids) * self.target_hidden_size == self.hidden_size:
            # fc is applied by input width (3·H_target vs H); equal widths would be ambiguous
            raise ValueError("len(aux_layer_ids) * target_hidden_size must differ from hidden_size")
        object.__setattr__(self, "num_experts_per_tok", min(self.num_experts_per_tok, self.num_experts))

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or max(1, self.intermediate_size // self.num_experts)

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layer_ids, **overrides) -> "DraftHeadConfig":
        """Shape a head after a Hugging Face Llama-like target config."""
        tc = target_config
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        rope = getattr(tc, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
        kw = dict(
            hidden_size=tc.hidden_size,
            target_hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", tc.num_attention_heads),
            head_dim=head_dim,
            vocab_size=tc.vocab_size,
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=tuple(aux_layer_ids),
            rms_norm_eps=tc.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=tc.max_position_embeddings,
        )
        kw.update(overrides)
        return cls(**kw)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Llama (rotate-half) rotary tables. position_ids: [B, T] -> cos, sin: [B, 1, T, head_dim]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, head_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, kv_heads, T, d] -> [B, kv_heads * n_rep, T, d]."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: DraftHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        in_dim = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(in_dim, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        # x: [B, T, 2H]
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend(q, k, v)  # [B, heads, T, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEMLP(nn.Module):
    """E SwiGLU experts, top-k softmax router on the MLP input, Switch-style load-balancing loss."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(DenseMLP(hidden, inter) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        probs = torch.softmax(self.router(flat).float(), dim=-1)  # [N, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [N, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        # load balance: E * sum_e (fraction of routed slots to e) * (mean router prob of e)
        frac = torch.zeros(self.num_experts, device=x.device).index_add_(
            0, chosen.reshape(-1), torch.ones(chosen.numel(), device=x.device)
        ) / max(1, chosen.numel())
        aux = self.num_experts * (frac * probs.mean(0)).sum()
        return out.view(shape), aux


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: DraftHeadConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.num_experts == 1:
            self.mlp: nn.Module = DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        else:
            self.mlp = MoEMLP(cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok)

    def forward(self, embeds, hidden, cos, sin, attend: AttendFn) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden: [B, T, H] -> (pre-norm output [B, T, H], router aux loss scalar)."""
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        residual = self.self_attn(x, cos, sin, attend) + residual
        mlp_in = self.post_attention_layernorm(residual)
        if isinstance(self.mlp, MoEMLP):
            mlp_out, aux = self.mlp(mlp_in)
        else:
            mlp_out, aux = self.mlp(mlp_in), residual.new_zeros((), dtype=torch.float32)
        return mlp_out + residual, aux


@dataclass(frozen=True)
class StepOutput:
    hidden: torch.Tensor  # [B, T, H] pre-norm output, fed to the next draft step
    logits: torch.Tensor | None  # [B, T, draft_vocab] (or [N, draft_vocab] when rows were selected)
    aux_loss: torch.Tensor  # router load-balancing loss (0 for dense)


def all_finite(t: torch.Tensor) -> bool:
    """True if `t` holds no NaN or inf. One sum decides for almost every tensor (NaN and inf propagate
    into it) without a mask the size of the tensor; only a non-finite sum (a non-finite value, or finite
    values large enough to overflow it) runs the exact element check. The sum runs in the tensor's own
    dtype when that has float32's range (float32, float64, bfloat16: bf16 sums accumulate in float32
    anyway, and asking for a float32 result converts the whole tensor first, ~30x slower on CPU);
    narrower dtypes (float16) sum into float32 so that ordinary values do not overflow."""
    t = t.detach()
    wide = t.dtype in (torch.float32, torch.float64, torch.bfloat16)
    if math.isfinite(float(t.sum() if wide else t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


class Eagle3DraftHead(nn.Module):
    """SGLang ``LlamaForCausalLMEagle3``-compatible EAGLE-3 head (see the module docstring)."""

    def __init__(self, cfg: DraftHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        if self.d2t.device.type != "meta":  # a layout without storage (checkpoint.load_head) gets its map loaded
            self.set_draft_vocab(torch.arange(cfg.draft_vocab_size))

    # ---- vocabulary -------------------------------------------------------------------------
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """target_ids: [draft_vocab] target token ids, strictly increasing."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).to(self.d2t.device)
        if ids.numel() != self.cfg.draft_vocab_size or (ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all())):
            raise ValueError("draft vocab must be draft_vocab_size strictly increasing target ids")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.cfg.vocab_size:  # checked before any buffer changes
            raise ValueError(f"draft vocab ids must lie in [0, {self.cfg.vocab_size}), got {int(ids[0])}..{int(ids[-1])}")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def dtype(self) -> torch.dtype:
        """The head's compute dtype (its norm weight's: linears may be packed, see cpu_linear.py)."""
        return self.norm.weight.dtype

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab] target id of each draft id."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    # ---- forward ----------------------------------------------------------------------------
    def project_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """fc only for aux features (width len(aux) * H_target); the head's own output passes through."""
        return self.fc(hidden) if hidden.shape[-1] == self.fc.in_features else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def step(
        self,
        input_ids: torch.Tensor,  # [B, T] tokens whose embeddings pair with `hidden`
        hidden: torch.Tensor,  # [B, T, 3 * H_target] or [B, T, H]
        position_ids: torch.Tensor,  # [B, T]
        attend: AttendFn,
        logits_rows: torch.Tensor | None | bool = True,  # True: all; bool mask [B, T]: those rows; False: none
    ) -> StepOutput:
        if not torch.is_autocast_enabled(hidden.device.type):
            hidden = hidden.to(self.dtype)  # e.g. bf16 target features into an fp32 head
        h = self.project_hidden(hidden)
        embeds = self.embed_tokens(input_ids).to(h.dtype)
        cos, sin = rotary_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)
        out, aux = self.midlayer(embeds, h, cos, sin, attend)
        if logits_rows is True:
            logits = self.logits(out)
        elif logits_rows is False or logits_rows is None:
            logits = None
        else:
            logits = self.logits(out[logits_rows])
        return StepOutput(hidden=out, logits=logits, aux_loss=aux)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal self-attention over the given keys (no cache)."""
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)


@dataclass
class DraftKVCache:
    """KV cache of the draft head's single layer, for drafting. Rows past `length` are unused."""

    keys: torch.Tensor  # [B, kv_heads, capacity, head_dim]
    values: torch.Tensor  # [B, kv_heads, capacity, head_dim]
    length: int = 0

    @classmethod
    def empty(cls, cfg: DraftHeadConfig, batch: int, capacity: int, dtype, device) -> "DraftKVCache":
        shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        if self.length + n > self.keys.shape[2]:
            grow = max(self.keys.shape[2], n)
            pad = lambda x: torch.cat([x, x.new_zeros(*x.shape[:2], grow, x.shape[3])], dim=2)  # noqa: E731
            self.keys, self.values = pad(self.keys), pad(self.values)
        self.keys[:, :, self.length : self.length + n] = k
        self.values[:, :, self.length : self.length + n] = v
        self.length += n

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the rows `index` (in order) of the cache, e.g. the accepted path."""
        k = self.keys[:, :, index]
        v = self.values[:, :, index]
        self.keys[:, :, : index.numel()] = k
        self.values[:, :, : index.numel()] = v
        self.length = index.numel()

    def attend_fn(self, mask: torch.Tensor | None = None) -> AttendFn:
        """An AttendFn that appends the new keys, then attends over the whole cache.

        mask: additive float mask [B or 1, 1, T_new, length_after] (0 = visible, -inf = hidden);
        None means the new tokens are a causal continuation of the cache.
        """

        def attend(q, k, v):
            self.append(k, v)
            keys, values = self.keys[:, :, : self.length], self.values[:, :, : self.length]
            # serving on a CPU: SDPA reads the KV heads in place (no copy of the context per head); under autograd
            # the copy stays, since later appends write into the buffer the backward pass reads
            gqa = q.device.type == "cpu" and not torch.is_grad_enabled()
            if not gqa:
                n_rep = q.shape[1] // k.shape[1]
                keys, values = repeat_kv(keys, n_rep), repeat_kv(values, n_rep)
            m = mask
            if m is None:
                t_new, total = q.shape[2], self.length
                m = continuation_mask(t_new, total, q.dtype, q.device)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=m.to(q.dtype), enable_gqa=gqa)

        return attend


def continuation_mask(t_new: int, total: int, dtype, device) -> torch.Tensor:
    """[1, 1, t_new, total] additive mask: new token i sees all cached keys and new keys <= i."""
    past = total - t_new
    i = torch.arange(t_new, device=device)[:, None]
    j = torch.arange(total, device=device)[None, :]
    visible = j <= past + i
    m = torch.zeros(t_new, total, dtype=torch.float32, device=device).masked_fill(~visible, float("-inf"))
    return m[None, None].to(dtype)


def init_weights(head: Eagle3DraftHead, std: float = 0.02) -> None:
    """Random init of the trainable weights (norms to 1); frozen embeddings are left alone."""
    for name, p in head.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        if name.endswith("norm.weight") or "layernorm" in name:
            nn.init.ones_(p)
        else:
            nn.init.normal_(p, std=std)
    # keep residual branches small at init
    with torch.no_grad():
        head.midlayer.self_attn.o_proj.weight.mul_(1 / math.sqrt(2))


__all__ = [
    "AttendFn",
    "DraftHeadConfig",
    "Eagle3DraftHead",
    "DraftKVCache",
    "StepOutput",
    "MoEMLP",
    "DenseMLP",
    "causal_attend",
    "continuation_mask",
    "init_weights",
    "rotary_cos_sin",
    "apply_rotary",
    "repeat_kv",
]
