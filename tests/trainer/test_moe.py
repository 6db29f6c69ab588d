"""trainer.moe: growing an expert preserves the head's function; routing supervision sends the grown
domain to its expert; routing reports add up; a MoE head round-trips through the registry, says in
head.json that SGLang cannot load it, is refused by the speculators export; the near-line trainer
grows once for a domain that stays low."""

import json
import math

import pytest
import torch

from adaptive_eagle.checkpoint import MOE_ARCH, HeadMeta
from adaptive_eagle.draft_head import causal_attend
from adaptive_eagle.interop import export_speculators
from adaptive_eagle.registry import HeadRegistry
from tests.adaptive_eagle.test_engine import tiny_setup
from trainer.moe import (
    MoEGrowth,
    dominant_expert,
    grow_expert,
    is_moe,
    moe_training_meta,
    routing_stats,
    routing_supervision,
    serving_meta,
)
from trainer.step import StepConfig, adamw, train_step
from trainer.traffic import TrafficBatch
from trainer.ttt import TTTBatch

VOCAB = 32


@pytest.fixture(scope="module")
def tiny64():
    return tiny_setup(seed=3, dtype=torch.float64)


@pytest.fixture(scope="module")
def tiny32():
    return tiny_setup(seed=3, dtype=torch.float32)


def outputs(head, seed=0, b=3, t=9):
    """(pre-norm hidden, logits) of one head step on random aux features."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(b, t, head.fc.in_features, generator=g, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    pos = torch.arange(t)[None].expand(b, t)
    with torch.no_grad():
        out = head.step(ids, aux, pos, causal_attend)
    return out.hidden, out.logits


def test_growth_from_dense_then_from_moe_preserves_outputs_exactly(tiny64):
    _, dense = tiny64
    two = grow_expert(dense, "code")
    assert two.experts == 2 and two.expert == 1 and two.source_expert == 0 and dict(two.domains) == {"code": 1}
    assert two.head.cfg.num_experts_per_tok == 1 and two.head.dtype == torch.float64 and not is_moe(dense)
    for seed in range(3):
        for a, b in zip(outputs(dense, seed), outputs(two.head, seed)):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    # make routing matter: expert 1 and the router drift away from the copies, then grow from expert 1
    with torch.no_grad():
        torch.manual_seed(1)
        for p in two.head.midlayer.mlp.experts[1].parameters():
            p.add_(0.05 * torch.randn_like(p))
        two.head.midlayer.mlp.router.weight.normal_(std=1.0)
    before = outputs(two.head, 7)
    three = grow_expert(two.head, "math", two.domains, source_expert=1)
    assert three.experts == 3 and dict(three.domains) == {"code": 1, "math": 2}
    for a, b in zip(before, outputs(three.head, 7)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="already has expert"):
        grow_expert(three.head, "code", three.domains, source_expert=0)
    with pytest.raises(ValueError, match="source_expert"):
        grow_expert(three.head, "chat", three.domains)


def domain_batch(target, head, seed, rows=8, t=20) -> TrafficBatch:
    """Half 'code' rows (tokens 0..7), half 'english' rows (tokens 16..31): domains the router can tell apart
    (in a random tiny target, token sets of 16 vs 16 are not linearly separable at the MLP input)."""
    g = torch.Generator().manual_seed(seed)
    domains = tuple("code" if i % 2 else "english" for i in range(rows))
    ids = torch.stack([(torch.randint(0, 8, (t,), generator=g) if d == "code" else torch.randint(16, 32, (t,), generator=g)) for d in domains])
    lengths = torch.full((rows,), t)
    lengths[-1] = t - 5  # some right padding
    mask = torch.ones(rows, t, dtype=torch.long)
    mask[:, 0] = 0
    feats = target.features(ids, (torch.arange(t)[None] < lengths[:, None]).long())
    w = target.output_embeddings()[head.draft_to_target]
    batch = TTTBatch.build(ids, mask, lengths, feats.aux, lambda need: feats.last[need] @ w.T)
    return TrafficBatch(batch, rows, int(lengths.sum()), int(mask.sum()), 0, domains)


def test_routing_supervision_sends_the_grown_domain_to_its_expert(tiny32):
    target, dense = tiny32
    grown = grow_expert(dense, "code")
    head = grown.head
    opt = adamw(head, 1e-2)
    cfg = StepConfig(ttt_steps=2, max_loss_rows=None)
    batches = [domain_batch(target, head, seed=s) for s in range(4)]
    for step in range(12):
        tb = batches[step % len(batches)]
        with routing_supervision(head, tb.batch, tb.domains, grown.domains) as extra:
            stats = train_step(head, tb.batch, opt, None, cfg, step=step, extra_loss=extra)
        assert math.isfinite(stats.loss)
    held_out = routing_stats(head, domain_batch(target, head, seed=1000))
    assert held_out["domains"]["code"]["load"][1] > 0.9, held_out
    assert held_out["domains"]["english"]["load"][1] < 0.25, held_out
    assert dominant_expert(held_out, "code") == 1 and dominant_expert(held_out, "english") == 0
    assert not head.midlayer.mlp.experts[0].gate_proj.weight.equal(head.midlayer.mlp.experts[1].gate_proj.weight)
    assert not head.midlayer.mlp._forward_hooks  # the hook lived only inside the with block


def test_routing_stats_add_up(tiny64):
    target, dense = tiny64
    head = grow_expert(grow_expert(dense, "code").head, "math", {"code": 1}, source_expert=0).head
    with torch.no_grad():
        head.midlayer.mlp.router.weight.normal_(std=2.0)
    tb = domain_batch(target, head, seed=5)
    s = routing_stats(head, tb)
    real = int((tb.batch.lengths - 1).sum())
    assert s["experts"] == 3 and s["top_k"] == 1 and s["tokens"] == real
    assert sum(d["tokens"] for d in s["domains"].values()) == real and set(s["domains"]) == {"code", "english"}
    for load in [s["load"]] + [d["load"] for d in s["domains"].values()]:
        assert len(load) == 3 and sum(load) == pytest.approx(1.0, abs=1e-5) and min(load) >= 0
    assert 0 < s["entropy"] <= s["max_entropy"] == pytest.approx(math.log(3), abs=1e-6)
    x = torch.randn(2, 5, head.cfg.hidden_size, dtype=torch.float64)  # MLP inputs: every position counts
    f = routing_stats(head, x, ["code", None])
    assert f["tokens"] == 10 and set(f["domains"]) == {"code", "untagged"}
    with pytest.raises(ValueError, match="domain tags"):
        routing_stats(head, x, ["code"])


def test_a_moe_head_round_trips_through_the_registry_and_says_sglang_cannot_load_it(tiny64, tmp_path):
    target, dense = tiny64
    grown = grow_expert(grow_expert(dense, "code").head, "math", {"code": 1}, source_expert=1)
    reg = HeadRegistry.create(tmp_path / "registry")
    meta = HeadMeta.new("moe-1", target.name, target.fingerprint,
                        training={"moe": moe_training_meta(grown.head, grown.domains)},
                        metrics={"serving": serving_meta(grown.head)})
    reg.register(grown.head, meta, dtype=torch.float32)
    loaded = reg.load("moe-1", target)
    assert loaded.config.num_experts == 3 and loaded.config.num_experts_per_tok == 1 and is_moe(loaded.head)
    for a, b in zip(outputs(grown.head), outputs(loaded.head.double())):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    v = reg.version("moe-1")
    assert v.training["moe"]["domains"] == {"code": 1, "math": 2} and v.training["moe"]["free_experts"] == [0]
    assert v.metrics["serving"]["sglang"] is False and "SGLang" in v.metrics["serving"]["reason"]
    assert json.loads((v.path / "config.json").read_text())["architectures"] == [MOE_ARCH]
    assert serving_meta(dense) == {"sglang": True}
    with pytest.raises(ValueError, match="3-expert head cannot be exported"):
        export_speculators(v.path, tmp_path / "spec", target=target)
    assert not (tmp_path / "spec").exists()


def test_growth_from_a_moe_head_copies_the_expert_the_domain_uses(tiny32):
    from collections import deque

    from adaptive_eagle.trace import TraceRecord
    from trainer.moe import mlp_inputs, real_positions

    target, dense = tiny32
    head = grow_expert(dense, "code").head
    tb = domain_batch(target, head, seed=3)  # odd rows: tokens 0..7, even rows: 16..31
    x, real = mlp_inputs(head, tb.batch), real_positions(tb.batch)
    low_tokens = torch.tensor([d == "code" for d in tb.domains])[:, None] & real
    with torch.no_grad():  # expert 1 takes the rows of tokens 0..7, expert 0 the rest
        head.midlayer.mlp.router.weight.zero_()
        head.midlayer.mlp.router.weight[1] = 10 * (x[low_tokens].mean(0) - x[~low_tokens & real].mean(0))
    g = MoEGrowth(max_experts=3, grow_after_records=1, domains={"code": 1})
    g.recent["math"] = deque(TraceRecord(f"m{i}", target.fingerprint, "v1", "reference", tuple(range(i, i + 8)),
                                         (0,) * 4 + (1,) * 4, domain="math") for i in range(3))
    g.low["math"] = 1
    grown = g.grow(head, target)
    assert grown.source_expert == 1 and grown.expert == 2 and g.domains == {"code": 1, "math": 2}
    assert g.grown[-1]["source_expert"] == 1 and g.due(grown.head) is None  # full at max_experts


def test_growth_state_follows_low_domains_and_round_trips():
    g = MoEGrowth(max_experts=3, grow_after_records=2)
    g.note_replay({"accept_length": 1.5, "domains": {"code": {"accept_length": 1.2}, "english": {"accept_length": 1.7},
                                                     "untagged": {"accept_length": 1.0}}})
    assert g.replay_low == {"code"}
    g.restore(g.state())
    assert g.replay_low == {"code"} and g.domains == {}
    g.reset({"moe": {"domains": {"code": 1}, "grown": [{"domain": "code"}]}})
    assert g.domains == {"code": 1} and g.replay_low == set() and len(g.grown) == 1


def test_nearline_trainer_grows_one_expert_for_a_domain_that_stays_low(tmp_path):
    from adaptive_eagle.trace import TraceRecord, VerifyStep
    from feature_store.config import StoreConfig
    from feature_store.writer import write_records
    from trainer.config import NearlineConfig
    from trainer.nearline import NearlineTrainer

    target, head = tiny_setup(seed=11, dtype=torch.float32)
    reg = HeadRegistry.create(tmp_path / "registry")
    reg.register(head, HeadMeta.new("v1", target.name, target.fingerprint), dtype=torch.float32)
    reg.set_champion("v1", expect="none")
    store = StoreConfig(backend="local", local_root=str(tmp_path / "store"), fsync=False, claim_idle_ms=3_600_000)
    records, g = [], torch.Generator().manual_seed(0)
    for i in range(16):  # tokens-only records (features regenerated); code served at accept length 1.0, english 4.0
        code = bool(i % 2)
        ids = (torch.randint(0, 8, (16,), generator=g) if code else torch.randint(16, 32, (16,), generator=g)).tolist()
        steps = tuple(VerifyStep(tree_size=4, accept_length=0 if code else 3, accepted_depth=0 if code else 3)
                      for _ in range(5))
        records.append(TraceRecord(f"r{i}", target.fingerprint, "v1", "reference", tuple(ids), (0,) * 6 + (1,) * 10,
                                   steps, domain="code" if code else "english"))
    write_records(store, records)
    cfg = NearlineConfig(registry=str(tmp_path / "registry"), work_dir=str(tmp_path / "work"), store=store,
                         batch_tokens=256, min_fresh_tokens=32, max_loss_rows=None, lr=1e-3, warmup_steps=0,
                         heldout_percent=20, candidate_every_tokens=400, min_candidate_tokens=100,
                         min_candidate_heldout=1, tree_depth=3, tree_topk=2, tree_draft_tokens=6, drift_min_records=2, drift_sustain=2,
                         moe_grow=True, moe_max_experts=3, moe_grow_after_records=3)
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    tr.poll()
    assert tr.status().moe["low"]["code"] >= 3 and "english" not in tr.status().moe["low"]
    while tr.fresh:
        assert tr.train_once(force=True) is not None
    assert tr.head.cfg.num_experts == 2 and tr.status().moe["domains"] == {"code": 1}  # grown once, not again
    assert tr.status().moe["grown"] == 1 and sum("grew expert 1 for domain code" in e for e in tr.events) == 1
    name = tr.write_candidate()
    v = tr.registry.version(name)
    assert v.training["moe"]["domains"] == {"code": 1} and v.metrics["serving"]["sglang"] is False
    assert sum(v.metrics["moe"]["load"]) == pytest.approx(1.0, abs=1e-5)
    tr.checkpoint()
    tr.close()
    resumed = NearlineTrainer(cfg, target=target)
    resumed.start()
    assert resumed.head.cfg.num_experts == 2 and resumed.moe.domains == {"code": 1}
    resumed.close()
