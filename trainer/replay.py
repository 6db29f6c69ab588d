"""Acceptance replay: score draft heads offline on recorded traffic, the way serving drafts.

Owns: replaying the EAGLE-2 dynamic tree of a head (adaptive_eagle.drafting, the engine's own
drafting code, with the serving tree parameters) against the continuation the target actually
committed, per record; per-record accept lengths, per-position acceptance (0-α…6-α), per-domain
tables, and the per-record samples the policy's tail gate reads; a candidate's head.json replay block, built
through the head format's model (adaptive_eagle.evidence.ReplayEvidence). Must not touch: the store, the
registry, optimizers.

Counterfactual. At every verify step the head drafts a tree from the committed prefix; the step
accepts the longest tree path that equals the recorded next tokens, plus one bonus token (what
greedy verification would have committed, since for greedy traffic the recorded tokens are the
target's argmax). For greedy traffic the replayed accept length is exact: it is what the head would
have achieved serving that request. For sampled traffic it is the acceptance of the tree against
the one continuation the target sampled (a point-mass estimate of rejection sampling: it
undercounts, by the chance that the target would have sampled the draft's token anyway, and it
scores both heads alike, so comparisons between heads stay fair). Model-free drafts (prompt
lookup, the suffix index) do not depend on the head and are left out.

Vocabulary: accept length = tokens committed per verify step, bonus included (1.0 = no speed-up).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from adaptive_eagle.draft_head import Eagle3DraftHead
from adaptive_eagle.drafting import HeadFeed, draft_tree
from adaptive_eagle.evidence import HELDOUT, PREQUENTIAL, ReplayEvidence, ReplaySample, ReplaySamples, ReplayTree
from adaptive_eagle.positions import context_position
from adaptive_eagle.targets import Target
from adaptive_eagle.trace import TraceRecord
from adaptive_eagle.tree import DraftTree
from adaptive_eagle.versions import PLAIN
from trainer.positions import DEFAULT_EDGES, bucket_label, bucket_of, buckets_below, check_edges

ALPHA_POSITIONS = 7  # 0-α … 6-α


@dataclass(frozen=True)
class TreeParams:
    """The serving tree parameters (adaptive_eagle.engine.EngineConfig's defaults)."""

    depth: int = 5
    topk: int = 4
    num_draft_tokens: int = 16
    min_path_prob: float = 0.02

    def __post_init__(self) -> None:
        if self.depth < 1 or self.topk < 1 or self.num_draft_tokens < 1 or not 0 <= self.min_path_prob < 1:
            raise ValueError(f"invalid tree params {self}: depth, topk, num_draft_tokens >= 1; 0 <= min_path_prob < 1")

    @classmethod
    def of(cls, engine_config) -> "TreeParams":
        return cls(engine_config.depth, engine_config.topk, engine_config.num_draft_tokens, engine_config.min_path_prob)


@dataclass(frozen=True)
class RecordReplay:
    request_id: str
    domain: str | None
    accepted: tuple[int, ...]  # per verify step: draft tokens accepted (bonus not counted)
    positions: tuple[int, ...] = ()  # per verify step: context position of its first draft (trainer.positions)
    # the record's context position (prompt + half the generated tokens, adaptive_eagle.positions), the same for
    # every head replayed on it: the policy's context guard slices by it. None: not known
    context: int | None = None

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def accept_length(self) -> float:
        """Mean tokens per verify step, bonus included (1.0 when nothing was replayed)."""
        return 1.0 + float(np.mean(self.accepted)) if self.accepted else 1.0


def accepted_along(tree: DraftTree, continuation: Sequence[int]) -> int:
    """Draft tokens greedy verification accepts when the target commits `continuation`: the length
    of the longest tree path equal to a prefix of it."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    node, depth = -1, 0
    while depth < len(continuation):
        nxt = next((c for c, p in enumerate(parents) if p == node and tokens[c] == continuation[depth]), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def replay_ready(head: Eagle3DraftHead, *, adopt: bool = False) -> Eagle3DraftHead:
    """A copy of `head` made for replay (eval, no gradients); on a CPU with FBGEMM its linears are fp16-packed
    (adaptive_eagle.cpu_linear), as a reference server on such a CPU runs them: 0.28 s instead of 1.14 s for a
    96-token record on a 2-core AMD EPYC, the same accepted counts. Registry heads are bf16, which fp16 holds
    exactly in its normal range; activations and sums stay fp32. Other dtypes and devices are only copied. A head
    already made ready is returned as is. adopt: the caller hands `head` over, and it is made ready in place
    instead of copied."""
    if getattr(head, "replay_ready", False):
        return head
    from adaptive_eagle.cpu_linear import fbgemm_fp16_available, pack_linears

    ready = (head if adopt else copy.deepcopy(head)).requires_grad_(False).eval()
    p = next(ready.parameters())
    if p.device.type == "cpu" and p.dtype == torch.float32 and fbgemm_fp16_available():  # float64: kept exact
        pack_linears(ready)
    ready.replay_ready = True
    return ready


@torch.no_grad()
def replay_record(head: Eagle3DraftHead, record: TraceRecord, aux: torch.Tensor, tree: TreeParams) -> RecordReplay:
    """Replay drafting over one record's generated tokens. aux: [T >= N - 1, n_aux * H] the target's
    aux features of the record's positions (captured or regenerated)."""
    ids = list(record.input_ids)
    gen = [i for i, m in enumerate(record.loss_mask) if m]
    if not gen or gen[0] == 0:
        return RecordReplay(record.request_id, record.domain, ())
    n_prompt = gen[0]  # ids[n_prompt] is the first generated token (from the prefill, no draft)
    device = next(head.parameters()).device
    aux = aux.to(device=device, dtype=head.dtype)
    feed = HeadFeed.empty(head, len(ids) + tree.depth + 2, device)
    feed.add(ids[1 : n_prompt + 1], aux[:n_prompt], 0)
    root_pos, accepted, positions = n_prompt, [], []
    while root_pos + 1 < len(ids):
        positions.append(root_pos + 1)
        t = draft_tree(head, feed.cache, feed.root(), root_pos, depth=tree.depth, topk=tree.topk,
                       budget=tree.num_draft_tokens, min_path_prob=tree.min_path_prob)
        a = accepted_along(t, ids[root_pos + 1 :]) if t.size else 0
        a = min(a, len(ids) - root_pos - 2)  # the bonus token must exist in the record too
        accepted.append(a)
        feed.add(ids[root_pos + 1 : root_pos + a + 2], aux[root_pos : root_pos + a + 1], root_pos)
        root_pos += a + 1
    return RecordReplay(record.request_id, record.domain, tuple(accepted), tuple(positions),
                        context=context_position(n_prompt, len(gen)))


def record_aux(target: Target | None, record: TraceRecord, aux_layer_ids: Sequence[int]) -> torch.Tensor:
    """The record's aux features at the head's layers: captured ones when they match, else one target
    prefill over the record (records captured without hidden states, e.g. from SGLang)."""
    if record.aux_hidden is not None and tuple(record.aux_layer_ids) == tuple(aux_layer_ids):
        return torch.from_numpy(record.aux_hidden)
    if target is None:
        raise ValueError(f"record {record.request_id} carries no usable hidden states and no target was given "
                         "to regenerate them")
    if tuple(target.aux_layer_ids) != tuple(aux_layer_ids):
        raise ValueError(f"target aux layers {target.aux_layer_ids} differ from the head's {tuple(aux_layer_ids)}")
    ids = torch.tensor([record.input_ids], device=target.device)
    return target.features(ids).aux[0].float().cpu()


@dataclass(frozen=True)
class ReplayScore:
    """One head's replay on a set of records."""

    records: tuple[RecordReplay, ...]

    @property
    def accept_lengths(self) -> list[float]:
        return [r.accept_length for r in self.records if r.steps]

    @property
    def mean(self) -> float:
        """Tokens per verify step over all steps (bonus included): what throughput follows."""
        steps = sum(r.steps for r in self.records)
        return 1.0 + sum(sum(r.accepted) for r in self.records) / steps if steps else 1.0

    def quantile(self, q: float) -> float:
        xs = self.accept_lengths
        return float(np.quantile(xs, q)) if xs else 1.0

    def alpha(self, positions: int = ALPHA_POSITIONS) -> list[float]:
        """j-α: P(step accepts >= j + 1 draft tokens | it accepted >= j), over every replayed step."""
        acc = np.array([a for r in self.records for a in r.accepted], dtype=np.int64)
        out = []
        for j in range(positions):
            eligible = int((acc >= j).sum())
            out.append(float((acc >= j + 1).sum() / eligible) if eligible else 0.0)
        return out

    def by_domain(self) -> dict[str, "ReplayScore"]:
        groups: dict[str, list[RecordReplay]] = {}
        for r in self.records:
            groups.setdefault(r.domain or "", []).append(r)
        return {d: ReplayScore(tuple(rs)) for d, rs in sorted(groups.items())}

    def by_position(self, edges: Sequence[int] = DEFAULT_EDGES) -> list[dict]:
        """The replay sliced by where each verify step starts in the context (trainer.positions): per
        bucket, verify steps, tokens per step (bonus included) and j-α. Buckets up to the furthest step;
        records replayed without positions are left out."""
        check_edges(edges)
        steps = [(p, a) for r in self.records if len(r.positions) == r.steps for p, a in zip(r.positions, r.accepted)]
        furthest = max((p for p, _ in steps), default=0)
        groups: dict[int, list[int]] = {}
        for p, a in steps:
            groups.setdefault(bucket_of(p, edges), []).append(a)
        out = []
        for i, (lo, hi) in enumerate(buckets_below(edges, furthest + 1)):
            acc = groups.get(i, [])
            score = ReplayScore((RecordReplay("", None, tuple(acc)),))
            out.append({"bucket": bucket_label(lo, hi), "start": lo, "end": hi, "steps": len(acc),
                        "accepted": sum(acc), "accept_length": round(score.mean, 4),
                        "alpha": [round(a, 4) for a in score.alpha()]})
        return out

    def summary(self) -> dict:
        out = {"records": len(self.records), "steps": sum(r.steps for r in self.records),
               "accept_length": round(self.mean, 4), "p5_accept_length": round(self.quantile(0.05), 4),
               "alpha": [round(a, 4) for a in self.alpha()]}
        domains = self.by_domain()
        if len(domains) > 1 or "" not in domains:
            out["domains"] = {d or "untagged": {"records": len(s.records), "accept_length": round(s.mean, 4),
                                                "p5_accept_length": round(s.quantile(0.05), 4)}
                              for d, s in domains.items()}
        return out

    def samples(self, version: str) -> list[dict]:
        """Per-record samples for the policy's gates (policies.samples.RequestSample fields)."""
        return [{"accept_length": r.accept_length, "head_version": version, "domain": r.domain,
                 "request_id": r.request_id, "tokens": sum(r.accepted) + r.steps, "context": r.context}
                for r in self.records if r.steps]


@dataclass
class ReplayReport:
    """Several heads replayed on the same records (features computed once per record)."""

    scores: dict[str, ReplayScore] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> records left out

    def summary(self, edges: Sequence[int] | None = None) -> dict:
        """Per head: ReplayScore.summary(); with `edges`, also its by-position slice under "by_position"."""
        heads = {name: {**s.summary(), **({"by_position": s.by_position(edges)} if edges is not None else {})}
                 for name, s in self.scores.items()}
        return {"heads": heads, "skipped": dict(self.skipped)}


def replay_heads(heads: dict[str, Eagle3DraftHead], records: Sequence[TraceRecord], target: Target | None,
                 tree: TreeParams = TreeParams(), progress=None) -> ReplayReport:
    """Replay every head on every record. All heads must share their aux layers (they draft for one
    target). Records of another target, or without generated tokens, are skipped and counted.
    progress: optional callable(done, total)."""
    if not heads:
        raise ValueError("replay_heads needs at least one head")
    layer_sets = {tuple(h.cfg.aux_layer_ids) for h in heads.values()}
    if len(layer_sets) != 1:
        raise ValueError(f"heads read different aux layers {sorted(layer_sets)}; replay them separately")
    aux_ids = layer_sets.pop()
    heads = {name: replay_ready(h) for name, h in heads.items()}
    per_head: dict[str, list[RecordReplay]] = {name: [] for name in heads}
    skipped: dict[str, int] = {}
    fingerprint = target.fingerprint if target is not None else None
    for i, rec in enumerate(records):
        reason = None
        if fingerprint is not None and rec.target_fingerprint != fingerprint:
            reason = "other target"
        elif sum(rec.loss_mask) < 2:
            reason = "fewer than 2 generated tokens"
        if reason is None:
            try:
                aux = record_aux(target, rec, aux_ids)
            except ValueError:
                reason = "no usable hidden states"
        if reason is not None:
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        for name, head in heads.items():
            per_head[name].append(replay_record(head, rec, aux, tree))
        if progress is not None:
            progress(i + 1, len(records))
    return ReplayReport({name: ReplayScore(tuple(rs)) for name, rs in per_head.items()}, skipped)


def replay_metrics(candidate: ReplayScore, champion: ReplayScore | None, champion_version: str, tree: TreeParams,
                   skipped: dict, greedy_records: int | None = None) -> dict:
    """What a candidate's head.json records of its held-out replay (adaptive_eagle.evidence.ReplayEvidence, as
    `metrics.replay`): both summaries and the per-record samples ([request_id, domain, accept_length, context
    position]) the policy's offline gate pairs by request id. With no champion head (plain decoding), every record
    scores 1.0 for the champion. greedy_records: how many replayed records were greedy; `exact` says whether all
    were (the replay is then what each head would have served, and the policy's canary only checks live health)."""
    champ = (champion.samples(champion_version) if champion is not None
             else [{**s, "accept_length": 1.0, "head_version": PLAIN} for s in candidate.samples(PLAIN)])
    sample = lambda s: ReplaySample(request_id=s["request_id"], domain=s["domain"],  # noqa: E731
                                    accept_length=round(s["accept_length"], 4), context=s.get("context"))
    return ReplayEvidence(
        evidence=HELDOUT, records=len(candidate.records), skipped=skipped, tree=ReplayTree(**tree.__dict__),
        candidate=candidate.summary(), champion=champion.summary() if champion is not None else None,
        champion_version=champion_version, greedy_records=greedy_records,
        exact=greedy_records is not None and greedy_records == len(candidate.records) > 0,
        samples=ReplaySamples(candidate=[sample(s) for s in candidate.samples("candidate")],
                              champion=[sample(s) for s in champ]),
    ).to_metrics()


def prequential_metrics(champion_version: str, tree: TreeParams) -> dict:
    """What a test-then-train snapshot's head.json records (`metrics.replay`): the kind, the champion its evidence
    is gathered against and the replay tree; the samples grow in its evidence file (adaptive_eagle.evidence)."""
    return ReplayEvidence(evidence=PREQUENTIAL, champion_version=champion_version, tree=ReplayTree(**tree.__dict__),
                          records=0).to_metrics()


__all__ = ["ALPHA_POSITIONS", "RecordReplay", "ReplayReport", "ReplayScore", "TreeParams", "accepted_along",
           "prequential_metrics", "record_aux", "replay_heads", "replay_metrics", "replay_ready", "replay_record"]
