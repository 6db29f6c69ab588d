"""The near-line trainer adapts the real shipped head to drifted traffic (real SmolLM2-135M, real ShareGPT).

The whole trainer path, as a stack runs it. SmolLM2 answers ShareGPT code prompts with plain greedy
decoding (the very tokens the shipped head's lossless speculative decoding commits), and each answer
becomes the record a capturing server writes: tokens, loss mask, plain-decoding steps and the target's
own aux and final hidden states. Here the answers are decoded in batches (`model.generate`, left
padded: the same tokens as the engine's one-at-a-time greedy decoding, about 3x faster on 2 cores) and
the hidden states come from one prefill over each record (equal to the engine's captured rows within
float rounding); `test_records_are_what_the_engine_captures` checks both on real prompts. The records
go into a local feature store; the near-line trainer, seeded with the shipped head as champion, reads
them through its consumer group, trains for a bounded budget (8 passes over the captured tokens, its
default learning rate and positions) and writes a candidate into the registry with its replay
evidence. The evidence is what the policy's offline gate judges: both heads replayed on the same
held-out records, here held-out code (the drift) and held-out English (what must not be forgotten).
Held-out records reach the trainer the way they do in production: through the store, split off by
request id.
"""

import itertools

import numpy as np
import pytest
import torch

from adaptive_eagle.checkpoint import load_head
from adaptive_eagle.cli import SHIPPED_HEAD
from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle.trace import SamplingParams, TraceRecord, VerifyStep
from feature_store.config import StoreConfig
from feature_store.writer import write_records
from trainer import data as D
from trainer.config import NearlineConfig
from trainer.nearline import NearlineTrainer, is_heldout

pytestmark = pytest.mark.slow

# sizes measured on this kind of machine: 8 held-out records make the gain a coin toss (the same
# trainer run read -3% on 8 records and +4.5% on 32), so the evidence gets most of the decoding time
TRAIN_CODE, TRAIN_TOKENS = 24, 96  # captured code requests the trainer learns from
HELDOUT = {"code": 32, "english": 16}  # held-out requests per domain
HELDOUT_TOKENS = 64
MAX_PASSES = 8  # the bounded budget: passes over the captured tokens (about 100 s of training on 2 cores)
HELDOUT_PERCENT = 25
ENGLISH_TOLERANCE = 0.05  # forgetting bound on 16 English records (bench/adapt.py holds 3% on 32, with English traffic)


def request_id(domain: str, k: int, heldout: bool) -> str:
    """The first id of the form <domain>-<k>-<n> that the trainer's stable split puts on the wanted side."""
    for n in itertools.count():
        rid = f"{domain}-{k}-{n}"
        if is_heldout(rid, HELDOUT_PERCENT) == heldout:
            return rid
    raise AssertionError("unreachable")


BATCH = 12  # answers decoded together


def greedy_answers(engine: SpeculativeEngine, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Plain greedy answers, decoded BATCH at a time (left padded), each cut after its first EOS."""
    model, out = engine.target.model, []
    pad = engine.target.tokenizer.pad_token_id
    pad = min(engine.eos_ids) if pad is None else pad
    for i in range(0, len(prompt_ids), BATCH):
        chunk = prompt_ids[i : i + BATCH]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=pad, eos_token_id=sorted(engine.eos_ids))
        for row in gen[:, width:].tolist():
            end = next((k + 1 for k, t in enumerate(row) if t in engine.eos_ids), len(row))
            out.append(row[:end])
    return out


def captured_record(engine: SpeculativeEngine, request_id: str, prompt: list[int], answer: list[int],
                    max_tokens: int, domain: str) -> TraceRecord:
    """The record a capturing server writes for a plain greedy request: every position but the last carries
    the target's aux and final hidden states (one prefill over the whole record)."""
    target, ids = engine.target, prompt + answer
    with torch.no_grad():
        f = target.features(torch.tensor([ids], device=target.device))
    n = len(ids) - 1
    return TraceRecord(request_id=request_id, target_fingerprint=target.fingerprint, head_version=None,
                       backend="reference", input_ids=tuple(ids),
                       loss_mask=tuple([0] * len(prompt) + [1] * len(answer)),
                       steps=tuple(VerifyStep(0, 0, 0) for _ in answer[1:]),  # the first comes from the prefill
                       sampling=SamplingParams(max_tokens=max_tokens), domain=domain,
                       aux_hidden=f.aux[0, :n].float().cpu().numpy(), aux_layer_ids=tuple(target.aux_layer_ids),
                       final_hidden=f.last[0, :n].float().cpu().numpy(),
                       compute=engine.binding.compute, lossless=engine.binding.lossless)


@pytest.fixture(scope="module")
def engine(smollm2):
    return SpeculativeEngine(smollm2, None, EngineConfig.plain())


@pytest.fixture(scope="module")
def captured(smollm2, engine):
    """Code traffic to learn from, and held-out code and English, as capturing servers record them."""
    head = load_head(SHIPPED_HEAD, smollm2)
    conversations = list(D.load_sharegpt())
    sets = [("code", "train", TRAIN_CODE, TRAIN_TOKENS, False),
            ("code", "heldout", HELDOUT["code"], HELDOUT_TOKENS, True),
            ("english", "heldout", HELDOUT["english"], HELDOUT_TOKENS, True)]
    records = []
    for domain, split, n, max_tokens, heldout in sets:
        prompts = [engine.encode(p) for p in D.first_user_messages(conversations, n, domains=[domain], split=split,
                                                                   max_chars=600)]
        for k, (prompt, answer) in enumerate(zip(prompts, greedy_answers(engine, prompts, max_tokens))):
            rid = request_id(f"{domain}-{split}", k, heldout)
            records.append(captured_record(engine, rid, prompt, answer, max_tokens, domain))
    return head, records


def test_records_are_what_the_engine_captures(smollm2, engine, captured):
    """Batched answers equal the engine's greedy answers token for token; the record equals the engine's
    captured record in every field but its hidden states, which agree within float rounding."""
    _, records = captured
    for rec in [r for r in records if r.domain == "code"][:2] + [r for r in records if r.domain == "english"][:1]:
        n_prompt = rec.loss_mask.index(1)
        prompt = list(rec.input_ids[:n_prompt])
        want = engine.generate(prompt, rec.sampling, capture=True, request_id=rec.request_id).trace
        assert rec.input_ids == want.input_ids and rec.loss_mask == want.loss_mask and rec.steps == want.steps
        for field in ("target_fingerprint", "head_version", "backend", "tenant", "sampling", "aux_layer_ids",
                      "compute", "lossless", "capture_consent", "schema_version"):
            assert getattr(rec, field) == getattr(want, field), field
        assert rec.aux_hidden.shape == want.aux_hidden.shape and rec.final_hidden.shape == want.final_hidden.shape
        np.testing.assert_allclose(rec.aux_hidden, want.aux_hidden, atol=5e-3, rtol=1e-5)
        np.testing.assert_allclose(rec.final_hidden, want.final_hidden, atol=5e-3, rtol=1e-5)


def test_near_line_candidate_beats_the_shipped_head_on_held_out_code_without_forgetting_english(
        smollm2, captured, tmp_path):
    head, records = captured
    registry = HeadRegistry.create(tmp_path / "registry")
    registry.add(SHIPPED_HEAD)
    registry.set_champion(head.meta.version, expect="none")
    store = StoreConfig(backend="local", local_root=str(tmp_path / "store"), fsync=False)
    write_records(store, records)

    torch.manual_seed(0)
    cfg = NearlineConfig(registry=str(tmp_path / "registry"), work_dir=str(tmp_path / "trainer"), store=store,
                         evidence="heldout", heldout_percent=HELDOUT_PERCENT, min_candidate_heldout=sum(HELDOUT.values()),
                         max_passes=MAX_PASSES,
                         candidate_every_tokens=10**9, checkpoint_every_s=10**6)
    trainer = NearlineTrainer(cfg, target=smollm2)
    trainer.start()
    while trainer.poll():
        pass
    assert {d: len(p) for d, p in trainer.heldout.items()} == HELDOUT
    assert len(trainer.fresh) == TRAIN_CODE

    # the bounded budget: the fresh traffic once, then idle passes over the buffer up to max_passes
    while trainer.train_once(force=bool(trainer.fresh)) is not None:
        pass
    assert trainer.counters["records_trained"] == TRAIN_CODE
    assert trainer.counters["tokens_trained"] >= (cfg.max_passes - 1) * trainer.counters["tokens_received"]

    name = trainer.write_candidate()
    version = registry.version(name)
    assert version.parent == head.meta.version and version.training["trainer"] == "nearline"
    replay = version.metrics["replay"]
    assert replay["records"] == sum(HELDOUT.values()) and replay["champion_version"] == head.meta.version
    cand, champ = replay["candidate"]["domains"], replay["champion"]["domains"]
    code_gain = cand["code"]["accept_length"] / champ["code"]["accept_length"] - 1
    english_change = cand["english"]["accept_length"] / champ["english"]["accept_length"] - 1
    print(f"held-out code {champ['code']['accept_length']:.3f} -> {cand['code']['accept_length']:.3f} "
          f"({code_gain:+.1%}); English {champ['english']['accept_length']:.3f} -> "
          f"{cand['english']['accept_length']:.3f} ({english_change:+.1%})")
    assert code_gain > 0.01, f"the candidate does not accept more on held-out code: {code_gain:+.2%}"
    assert english_change >= -ENGLISH_TOLERANCE, f"English accept length dropped {english_change:+.2%}"
