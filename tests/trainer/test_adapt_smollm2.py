"""The near-line trainer adapts the real shipped head to drifted traffic (real SmolLM2-135M, real ShareGPT).

The whole trainer path, as a stack runs it: SmolLM2 decodes ShareGPT code prompts through the engine
with capture on (plain greedy decoding: the very tokens the shipped head's lossless speculative
decoding commits, about 1.5x faster on this CPU than its fixed 16-node tree; the features are the
target's own either way); the records go into a local feature store; the near-line trainer, seeded
with the shipped head as champion, reads them through its consumer group, trains for a bounded budget
(8 passes over the captured tokens, its default learning rate and positions) and writes a candidate
into the registry with its replay evidence. The evidence is what the policy's offline gate judges:
both heads replayed on the same held-out records, here held-out code (the drift) and held-out English
(what must not be forgotten). Held-out records reach the trainer the way they do in production:
through the store, split off by request id.
"""

import itertools

import pytest
import torch

from adaptive_eagle.checkpoint import load_head
from adaptive_eagle.cli import SHIPPED_HEAD
from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle.trace import SamplingParams, TraceRecord
from feature_store.config import StoreConfig
from feature_store.writer import StoreWriter
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


@pytest.fixture(scope="module")
def captured(smollm2):
    """Code traffic to learn from, and held-out code and English, decoded greedily with capture on."""
    head = load_head(SHIPPED_HEAD, smollm2)
    engine = SpeculativeEngine(smollm2, None, EngineConfig.plain())
    conversations = list(D.load_sharegpt())
    sets = [("code", "train", TRAIN_CODE, TRAIN_TOKENS, False),
            ("code", "heldout", HELDOUT["code"], HELDOUT_TOKENS, True),
            ("english", "heldout", HELDOUT["english"], HELDOUT_TOKENS, True)]
    records = []
    for domain, split, n, max_tokens, heldout in sets:
        for k, prompt in enumerate(D.first_user_messages(conversations, n, domains=[domain], split=split,
                                                         max_chars=600)):
            rid = request_id(f"{domain}-{split}", k, heldout)
            trace = engine.generate(prompt, SamplingParams(max_tokens=max_tokens), capture=True, request_id=rid).trace
            records.append(TraceRecord(**{**trace.__dict__, "domain": domain}))
    return head, records


def test_near_line_candidate_beats_the_shipped_head_on_held_out_code_without_forgetting_english(
        smollm2, captured, tmp_path):
    head, records = captured
    registry = HeadRegistry.create(tmp_path / "registry")
    registry.add(SHIPPED_HEAD)
    registry.set_champion(head.meta.version, expect="none")
    store = StoreConfig(backend="local", local_root=str(tmp_path / "store"), fsync=False)
    writer = StoreWriter(store)
    for rec in records:
        writer.put(rec)
    writer.close()

    torch.manual_seed(0)
    cfg = NearlineConfig(registry=str(tmp_path / "registry"), work_dir=str(tmp_path / "trainer"), store=store,
                         heldout_percent=HELDOUT_PERCENT, min_candidate_heldout=sum(HELDOUT.values()),
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
