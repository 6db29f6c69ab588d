"""MoE growth: a draft head grows an expert for a domain whose acceptance stays low.

Owns: growing a head by one expert (``grow_expert``: dense → 2 experts, E → E+1), the routing
supervision that teaches the router to send the grown domain to its expert (``routing_supervision``,
an ``extra_loss`` for ``trainer.step.train_step``), routing reports (``routing_stats``: entropy and
per-expert load, per domain), what head.json says about a MoE head (``moe_training_meta``,
``serving_meta``, ``candidate_meta``), and the near-line trainer's growth state (``MoEGrowth``: which
domain stayed low for long enough, the domain → expert map, checkpointed with the trainer).
Must not touch: the head math (``adaptive_eagle/draft_head.py``: its modules are built, copied and
hooked here, never re-implemented), the store, the registry, the near-line loop itself.

Vocabulary. A *grown* expert belongs to one domain (head.json ``training.moe.domains``, e.g.
``{"code": 1}``); the other experts are *free* (expert 0, the dense MLP the head was born with, is
always free). Rows of a grown domain are routed to its expert; every other row (other domains,
untagged traffic) to the free experts.

Growth preserves the head's function exactly. Grown heads route top-1 (``num_experts_per_tok=1``),
so an MoE head's MLP output is the chosen expert's output times p/p = 1. From a dense head: two
experts, both copies of the dense MLP, and a zero router (every expert ties; whichever top-1 picks
computes the dense MLP). From an E-expert head: expert E is a copy of the *source* expert (the one
the domain's rows mostly use), and its router row a copy of the source's row, so the two tie
wherever the source would have been chosen and either choice computes the same thing. The tie
is broken only by training: the routing supervision pushes the domain's rows towards the new row
and everything else towards the free rows. Under top-1 the TTT loss itself gives the router no
gradient (p/p has none), so the router learns from the supervision alone; the Switch load-balance
loss is switched off on grown heads (``router_aux_loss_coef=0``): their load is meant to follow the
traffic's domain mix, not to be uniform.

Routing supervision. The MoE MLP's input at TTT step 0 (one row per real position, captured with a
forward hook, detached: the supervision trains the router only) gives router logits z; a row of a
grown domain d has loss -log softmax(z)[expert(d)], any other row -log sum over free experts of
softmax(z). The mean over real positions, times a weight, is added to the step's loss.

SGLang and vLLM cannot serve a MoE head (checkpoint.py saves it under an architecture neither
registers; interop.py refuses the speculators export): head.json says so in ``metrics.serving``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from adaptive_eagle.draft_head import Eagle3DraftHead, MoEMLP, causal_attend
from adaptive_eagle.targets import Target
from adaptive_eagle.trace import TraceRecord
from trainer.drift import DriftMonitor
from trainer.traffic import TrafficBatch, make_traffic_batch, row_from_record
from trainer.ttt import TTTBatch, shift_left

ROUTING_WEIGHT = 1.0  # weight of the routing supervision next to the TTT loss
SGLANG_REFUSAL = ("a MoE-routed draft head: SGLang's and vLLM's EAGLE-3 heads have a dense MLP, so neither can "
                  "load it (saved as AdaptiveEagleMoEForCausalLMEagle3; the speculators export refuses it); "
                  "only the reference engine serves it")
MEASURE_RECORDS = 8  # recent records per domain kept to measure which expert the domain uses
MEASURE_MAX_LEN = 256  # tokens per record in that measurement
STATS_RECORDS = 32  # held-out records a candidate's routing report is computed on


def is_moe(head: Eagle3DraftHead) -> bool:
    return isinstance(head.midlayer.mlp, MoEMLP)


@dataclass(frozen=True)
class GrownHead:
    head: Eagle3DraftHead  # the grown head (same device, dtype and train/eval mode as its parent)
    domain: str  # the domain the new expert serves
    expert: int  # index of the new expert
    source_expert: int  # expert it was copied from (0 for a dense parent: its MLP)
    domains: Mapping[str, int]  # domain -> expert after growth (read-only)

    @property
    def experts(self) -> int:
        return self.head.cfg.num_experts

    def describe(self) -> str:
        return (f"moe: grew expert {self.expert} for domain {self.domain} (copy of expert {self.source_expert}); "
                f"{self.experts} experts, domains {dict(self.domains)}")


def _mlp_state(head: Eagle3DraftHead) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the head's state without the MLP, the MLP's own state) — detached references."""
    prefix = "midlayer.mlp."
    sd = head.state_dict()
    rest = {k: v for k, v in sd.items() if not k.startswith(prefix)}
    return rest, {k.removeprefix(prefix): v for k, v in sd.items() if k.startswith(prefix)}


def _expert_state(mlp: dict[str, torch.Tensor], e: int | None) -> dict[str, torch.Tensor]:
    """gate/up/down of expert `e` (None: the dense MLP itself)."""
    p = "" if e is None else f"experts.{e}."
    return {k: mlp[p + k] for k in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")}


def grow_expert(head: Eagle3DraftHead, domain: str, domains: Mapping[str, int] | None = None,
                source_expert: int | None = None, *, router_aux_loss_coef: float = 0.0) -> GrownHead:
    """A new head with one more expert, for `domain`, that computes exactly what `head` computes.

    Dense `head`: 2 experts (both its MLP), zero router, new expert 1, source 0. MoE `head` (must route
    top-1): expert E copied from `source_expert`, router row tied with the source's (see the module
    docstring); `source_expert` is required (``dominant_expert`` of ``routing_stats`` on the domain's
    rows measures it). `domains`: the existing domain -> expert map. `head` is left untouched.
    """
    domains = dict(domains or {})
    if not domain:
        raise ValueError("an expert is grown for a tagged domain (untagged traffic stays on the free experts)")
    if domain in domains:
        raise ValueError(f"domain {domain!r} already has expert {domains[domain]}")
    cfg, moe = head.cfg, is_moe(head)
    rest, mlp = _mlp_state(head)
    if not moe:
        source, new = 0, 1
        new_cfg = dataclasses.replace(cfg, num_experts=2, num_experts_per_tok=1, router_aux_loss_coef=router_aux_loss_coef,
                                      moe_intermediate_size=cfg.intermediate_size)
        experts = [_expert_state(mlp, None), _expert_state(mlp, None)]
        router = torch.zeros(2, cfg.hidden_size, dtype=mlp["gate_proj.weight"].dtype, device=mlp["gate_proj.weight"].device)
    else:
        if cfg.num_experts_per_tok != 1:
            raise ValueError(f"growth preserves a MoE head's outputs only under top-1 routing; this head routes "
                             f"top-{cfg.num_experts_per_tok}")
        if source_expert is None or not 0 <= source_expert < cfg.num_experts:
            raise ValueError(f"source_expert {source_expert!r} must name one of the head's {cfg.num_experts} experts "
                             "(measure it: dominant_expert(routing_stats(head, batch), domain))")
        source, new = source_expert, cfg.num_experts
        new_cfg = dataclasses.replace(cfg, num_experts=new + 1, router_aux_loss_coef=router_aux_loss_coef,
                                      moe_intermediate_size=cfg.expert_intermediate_size)
        experts = [_expert_state(mlp, e) for e in range(new)] + [_expert_state(mlp, source)]
        router = torch.cat([mlp["router.weight"], mlp["router.weight"][source : source + 1]], dim=0)
    state = dict(rest, **{"midlayer.mlp.router.weight": router})
    for e, ex in enumerate(experts):
        state.update({f"midlayer.mlp.experts.{e}.{k}": v for k, v in ex.items()})
    device = head.fc.weight.device
    grown = Eagle3DraftHead(new_cfg).to(device=device, dtype=head.dtype)
    grown.load_state_dict(state, strict=True)  # copies (and casts to each parameter's dtype)
    grown.embed_tokens.weight.requires_grad_(False)
    grown.train(head.training)
    return GrownHead(grown, domain, new, source, {**domains, domain: new})


# ---- routing: the MoE MLP's input, stats, supervision -------------------------------------------
class _FirstInput:
    """Forward hook keeping the first input it sees (TTT step 0: every position of the batch)."""

    def __init__(self) -> None:
        self.x: torch.Tensor | None = None  # [B, T, H]

    def __call__(self, module, args, output) -> None:
        if self.x is None:
            self.x = args[0]


@contextlib.contextmanager
def captured_mlp_input(head: Eagle3DraftHead) -> Iterator[_FirstInput]:
    """Hook the head's MoE MLP for the duration; `.x` is the input of its first call."""
    if not is_moe(head):
        raise ValueError("the head has a dense MLP: nothing is routed")
    cap = _FirstInput()
    handle = head.midlayer.mlp.register_forward_hook(cap)
    try:
        yield cap
    finally:
        handle.remove()


def real_positions(batch: TTTBatch) -> torch.Tensor:
    """[B, T] bool: positions whose step-0 token (x_{t+1}) is a real token."""
    t = batch.input_ids.shape[1]
    return torch.arange(t, device=batch.lengths.device)[None] + 1 < batch.lengths[:, None]


def mlp_inputs(head: Eagle3DraftHead, batch: TTTBatch) -> torch.Tensor:
    """[B, T, H] the MoE MLP's input at TTT step 0 (no gradient), as training sees it."""
    b, t = batch.input_ids.shape
    positions = torch.arange(t, device=batch.input_ids.device)[None].expand(b, t)
    with torch.no_grad(), captured_mlp_input(head) as cap:
        head.step(shift_left(batch.input_ids, 1), batch.aux, positions, causal_attend, logits_rows=False)
    return cap.x


def _load(chosen: torch.Tensor, experts: int) -> list[float]:
    counts = torch.bincount(chosen.reshape(-1), minlength=experts).double()
    return [round(float(c), 6) for c in counts / max(1, chosen.numel())]


def _entropy(probs: torch.Tensor) -> float:
    return float(-(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()) if probs.numel() else 0.0


def routing_stats(head: Eagle3DraftHead, batch_or_features: TrafficBatch | TTTBatch | torch.Tensor,
                  domains: Sequence[str | None] | None = None) -> dict:
    """Routing entropy and per-expert load, overall and per domain.

    batch_or_features: a TrafficBatch (its domains are used when `domains` is None), a TTTBatch (real
    positions only), or MLP inputs [B, T, H] (every position counts). domains: one tag per row.
    Load = fraction of routed slots per expert (of tokens, under top-1); entropy = mean per-token
    entropy of the router's softmax, in nats (at most log E).
    """
    if isinstance(batch_or_features, TrafficBatch):
        domains = batch_or_features.domains if domains is None else domains
        batch_or_features = batch_or_features.batch
    if isinstance(batch_or_features, TTTBatch):
        x, real = mlp_inputs(head, batch_or_features), real_positions(batch_or_features)
    else:
        x = batch_or_features
        real = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    domains = list(domains) if domains is not None and len(domains) else [None] * x.shape[0]
    if len(domains) != x.shape[0]:
        raise ValueError(f"{len(domains)} domain tags for {x.shape[0]} rows")
    mlp: MoEMLP = head.midlayer.mlp
    with torch.no_grad():
        probs = torch.softmax(mlp.router(x[real].to(mlp.router.weight.dtype)).float(), dim=-1)  # [N, E]
        chosen = probs.topk(mlp.top_k, dim=-1).indices  # [N, k]
    row_of = torch.arange(x.shape[0], device=x.device)[:, None].expand(real.shape)[real]  # [N]
    out = {"experts": mlp.num_experts, "top_k": mlp.top_k, "tokens": int(probs.shape[0]),
           "entropy": round(_entropy(probs), 6), "max_entropy": round(math.log(mlp.num_experts), 6),
           "load": _load(chosen, mlp.num_experts), "domains": {}}
    for name in sorted({d or "untagged" for d in domains}):
        rows = torch.tensor([i for i, d in enumerate(domains) if (d or "untagged") == name], device=x.device)
        sel = torch.isin(row_of, rows)
        out["domains"][name] = {"tokens": int(sel.sum()), "entropy": round(_entropy(probs[sel]), 6),
                                "load": _load(chosen[sel], mlp.num_experts)}
    return out


def dominant_expert(stats: dict, domain: str) -> int:
    """The expert that gets most of `domain`'s tokens in a routing_stats report."""
    load = stats["domains"][domain or "untagged"]["load"]
    return max(range(len(load)), key=lambda e: load[e])


def routing_loss(router_logits: torch.Tensor, labels: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -log p[label] (label >= 0) or -log sum_{free} p (label -1).

    router_logits: [N, E]; labels: [N] long; free: [E] bool (experts of no domain)."""
    logp = F.log_softmax(router_logits.float(), dim=-1)
    own = labels >= 0
    nll_own = -logp[own].gather(1, labels[own, None]).squeeze(1)
    nll_free = -torch.logsumexp(logp[~own][:, free], dim=-1)
    return torch.cat([nll_own, nll_free]).mean() if labels.numel() else logp.new_zeros(())


@contextlib.contextmanager
def routing_supervision(head: Eagle3DraftHead, batch: TTTBatch, domains: Sequence[str | None],
                        domain_experts: Mapping[str, int], weight: float = ROUTING_WEIGHT,
                        ) -> Iterator[Callable[[], torch.Tensor] | None]:
    """Yields the `extra_loss` for one train_step on `batch` (None when there is nothing to supervise:
    a dense head, or no grown domain). The hook lives only inside the `with` block."""
    if not is_moe(head) or not domain_experts:
        yield None
        return
    if len(domains) != batch.input_ids.shape[0]:
        raise ValueError(f"{len(domains)} domain tags for {batch.input_ids.shape[0]} rows")
    mlp: MoEMLP = head.midlayer.mlp
    free = torch.ones(mlp.num_experts, dtype=torch.bool, device=batch.input_ids.device)
    free[list(domain_experts.values())] = False
    row_label = torch.tensor([domain_experts.get(d, -1) if d else -1 for d in domains], device=free.device)
    real = real_positions(batch)
    labels = row_label[:, None].expand(real.shape)[real]  # [N]
    with captured_mlp_input(head) as cap:

        def extra() -> torch.Tensor:
            if cap.x is None:
                raise RuntimeError("routing supervision: the head's MoE MLP did not run in this step")
            x = cap.x.detach()[real]  # [N, H]: the supervision trains the router only
            return weight * routing_loss(mlp.router(x), labels, free)

        yield extra


# ---- head.json ----------------------------------------------------------------------------------
def serving_meta(head: Eagle3DraftHead) -> dict:
    """metrics.serving of a head: whether SGLang (and vLLM) can load it, and why not."""
    return {"sglang": False, "reason": SGLANG_REFUSAL} if is_moe(head) else {"sglang": True}


def moe_training_meta(head: Eagle3DraftHead, domains: Mapping[str, int], grown: Sequence[dict] = ()) -> dict:
    """training.moe of a MoE head: experts, top-k, the domain -> expert map and the growth history."""
    return {"experts": head.cfg.num_experts, "top_k": head.cfg.num_experts_per_tok, "domains": dict(domains),
            "free_experts": [e for e in range(head.cfg.num_experts) if e not in set(domains.values())],
            "grown": [dict(g) for g in grown], "routing_supervision": "cross-entropy on step-0 router logits, "
            f"weight {ROUTING_WEIGHT}: a grown domain to its expert, other rows to the free experts"}


def domains_of(training: Mapping) -> dict[str, int]:
    """The domain -> expert map a head.json's training block records ({} when none)."""
    moe = (training or {}).get("moe") or {}
    return {str(d): int(e) for d, e in (moe.get("domains") or {}).items()}


def _domain_batch(head: Eagle3DraftHead, target: Target, records: Sequence[TraceRecord],
                  max_len: int = MEASURE_MAX_LEN) -> TrafficBatch | None:
    """A batch of the records (features regenerated where not captured); None when none is usable."""
    rows = [row_from_record(r, head.cfg.aux_layer_ids, "all", max_len) for r in records if len(r.input_ids) >= 4]
    return make_traffic_batch(target, head, rows) if rows else None


def candidate_meta(head: Eagle3DraftHead, target: Target, records: Sequence[TraceRecord],
                   growth: MoEGrowth | None) -> tuple[dict, dict]:
    """(training, metrics) additions to a candidate's head.json: {} for a dense head; for a MoE head
    training.moe, metrics.moe (routing_stats on up to STATS_RECORDS of `records`) and metrics.serving."""
    if not is_moe(head):
        return {}, {}
    domains, grown = (growth.domains, growth.grown) if growth is not None else ({}, [])
    metrics: dict = {"serving": serving_meta(head)}
    tb = _domain_batch(head, target, [r for r in records if len(r.input_ids) >= 4][-STATS_RECORDS:])
    if tb is not None:
        metrics["moe"] = routing_stats(head, tb)
    return {"moe": moe_training_meta(head, domains, grown)}, metrics


# ---- the near-line trainer's growth state -------------------------------------------------------
@dataclass
class MoEGrowth:
    """When to grow and for which domain; the domain -> expert map of the head being trained.

    A domain is *low* on a record when the drift monitor flags it, or when the last acceptance replay
    put it below the overall replayed accept length; `grow_after_records` consecutive low records of
    a domain without an expert make it due, while the head has fewer than `max_experts` experts.
    """

    max_experts: int
    grow_after_records: int
    routing_weight: float = ROUTING_WEIGHT
    domains: dict[str, int] = field(default_factory=dict)
    grown: list[dict] = field(default_factory=list)
    low: dict[str, int] = field(default_factory=dict)  # domain -> consecutive low records
    replay_low: set[str] = field(default_factory=set)
    recent: dict[str, deque] = field(default_factory=dict)  # domain -> recent records (without hidden states)

    def observe(self, rec: TraceRecord, drift: DriftMonitor) -> None:
        """One routed record (after the drift monitor has seen it)."""
        if not rec.domain:
            return
        flagged = drift.table().get(rec.domain, {}).get("flagged", False)
        self.low[rec.domain] = self.low.get(rec.domain, 0) + 1 if flagged or rec.domain in self.replay_low else 0
        self.recent.setdefault(rec.domain, deque(maxlen=MEASURE_RECORDS)).append(rec.without_hidden())

    def note_replay(self, summary: dict) -> None:
        """A candidate's replay summary (ReplayScore.summary()): domains below the overall accept length."""
        overall = summary.get("accept_length", 0.0)
        self.replay_low = {d for d, s in (summary.get("domains") or {}).items()
                           if d != "untagged" and s["accept_length"] < overall}

    def due(self, head: Eagle3DraftHead) -> str | None:
        if head.cfg.num_experts >= self.max_experts or (is_moe(head) and head.cfg.num_experts_per_tok != 1):
            return None  # full, or a top-k > 1 head (growth could not preserve its outputs)
        ready = [d for d, n in self.low.items() if n >= self.grow_after_records and d not in self.domains]
        return max(ready, key=lambda d: (self.low[d], d)) if ready else None

    def grow(self, head: Eagle3DraftHead, target: Target) -> GrownHead | None:
        """Grow an expert for the most persistently low domain, when one is due; None otherwise."""
        domain = self.due(head)
        if domain is None:
            return None
        grown = grow_expert(head, domain, self.domains, self._source_expert(head, target, domain))
        self.domains = dict(grown.domains)
        self.grown.append({"domain": domain, "expert": grown.expert, "source_expert": grown.source_expert,
                           "low_records": self.low.get(domain, 0)})
        self.low[domain] = 0
        return grown

    def _source_expert(self, head: Eagle3DraftHead, target: Target, domain: str) -> int | None:
        """The expert the domain's recent rows mostly use (None for a dense head; 0 with no rows to measure)."""
        if not is_moe(head):
            return None
        tb = _domain_batch(head, target, list(self.recent.get(domain, ())))
        if tb is None:
            return 0
        stats = routing_stats(head, tb)
        return dominant_expert(stats, domain) if stats["domains"].get(domain, {}).get("tokens") else 0

    def supervise(self, head: Eagle3DraftHead, tb: TrafficBatch):
        """routing_supervision for one step on `tb` (a context manager yielding the extra_loss or None)."""
        return routing_supervision(head, tb.batch, tb.domains, self.domains, self.routing_weight)

    def reset(self, training: Mapping | None) -> None:
        """A new starting head: its map (from its head.json training block), no counts."""
        self.domains, self.grown = domains_of(training or {}), list(((training or {}).get("moe") or {}).get("grown", []))
        self.low, self.replay_low = {}, set()

    def state(self) -> dict:
        return {"domains": dict(self.domains), "grown": list(self.grown), "low": dict(self.low),
                "replay_low": sorted(self.replay_low)}

    def restore(self, state: Mapping | None) -> None:
        state = state or {}
        self.domains = {str(d): int(e) for d, e in state.get("domains", {}).items()}
        self.grown, self.low = list(state.get("grown", [])), dict(state.get("low", {}))
        self.replay_low = set(state.get("replay_low", []))

    def status(self) -> dict:
        return {"domains": dict(self.domains), "grown": len(self.grown), "max_experts": self.max_experts,
                "low": {d: n for d, n in sorted(self.low.items()) if n}}


__all__ = [
    "ROUTING_WEIGHT",
    "SGLANG_REFUSAL",
    "GrownHead",
    "MoEGrowth",
    "candidate_meta",
    "captured_mlp_input",
    "domains_of",
    "dominant_expert",
    "grow_expert",
    "is_moe",
    "mlp_inputs",
    "moe_training_meta",
    "real_positions",
    "routing_loss",
    "routing_stats",
    "routing_supervision",
    "serving_meta",
]
