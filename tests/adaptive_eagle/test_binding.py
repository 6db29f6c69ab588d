"""Hot swap: per-request head binding, refused heads, shared embeddings, persisted calibration."""

import json
import threading

import pytest
import torch

from adaptive_eagle.binding import CalibrationStore, HeadBinding, check_head, prepare_head
from adaptive_eagle.costmodel import AcceptCalibration
from adaptive_eagle.draft_head import DraftHeadConfig, Eagle3DraftHead, init_weights
from adaptive_eagle.engine import EngineConfig, GenerationError, SpeculativeEngine
from adaptive_eagle.trace import SamplingParams
from tests.adaptive_eagle.test_engine import DEVICE, PINNED, plain_greedy, tiny_setup

FIXED = dict(depth=4, topk=3, num_draft_tokens=10, cost_aware=False, prompt_lookup=False, suffix_drafting=False,
             calibration_dir="")  # nothing persisted into the user's cache by tests


def other_head(target, seed):
    cfg = DraftHeadConfig.from_target(target.config, draft_vocab_size=target.config.vocab_size,
                                      aux_layer_ids=target.aux_layer_ids)
    torch.manual_seed(seed)
    head = Eagle3DraftHead(cfg)
    init_weights(head, std=0.1)
    head.embed_tokens.weight.data.copy_(target.input_embeddings())
    return head.to(target.dtype).to(DEVICE)


def test_swap_mid_request_finishes_on_the_bound_head_and_the_next_request_uses_the_new_one(tmp_path):
    target, v1 = tiny_setup(seed=0)
    v2 = other_head(target, seed=99)
    cfg = EngineConfig(**{**FIXED, "calibration_dir": str(tmp_path)})
    engine = SpeculativeEngine(target, v1, cfg, head_version="v1")
    prompt, sp = [5, 9, 3, 17, 4], SamplingParams(max_tokens=24)
    engine.eos_ids = set()
    reference = SpeculativeEngine(target, v1, cfg, head_version="v1")  # the same request, never swapped
    reference.eos_ids = set()
    want_v1 = reference.generate(prompt, sp)
    stream = engine.stream(prompt, sp)
    next(stream)  # the request is under way, bound to v1
    swap = engine.set_head(v2, "v2")
    assert swap.ok and swap.version == "v2" and engine.head_version == "v2" and swap.install_ms > 0
    result = None
    for _, res in stream:
        result = res or result
    assert result.trace.head_version == "v1" and result.head_version == "v1"
    # drafted with v1 to the end: the same trees and acceptances as the request that never saw a swap
    assert result.steps == want_v1.steps
    assert result.token_ids == plain_greedy(target, prompt, 24)
    after = engine.generate(prompt, sp)
    assert after.trace.head_version == "v2" and after.token_ids == result.token_ids
    only_v2 = SpeculativeEngine(target, v2, cfg, head_version="v2")
    only_v2.eos_ids = set()
    assert after.steps == only_v2.generate(prompt, sp).steps
    assert after.steps != result.steps  # v2 really drafts differently (else the test proves nothing)


def test_a_refused_head_leaves_the_old_one_serving():
    target, v1 = tiny_setup(seed=1)
    engine = SpeculativeEngine(target, v1, EngineConfig(**FIXED), head_version="v1")
    bad = other_head(target, seed=5)
    with torch.no_grad():
        bad.fc.weight[0, 0] = float("nan")
    res = engine.set_head(bad, "v-nan")
    assert not res.ok and "fc.weight" in res.message and "non-finite" in res.message and res.version == "v1"
    wrong_aux = other_head(target, seed=6)
    wrong_aux.cfg = DraftHeadConfig(**{**wrong_aux.cfg.to_dict(), "aux_layer_ids": [1, 2, 3]})
    res = engine.set_head(wrong_aux, "v-aux")
    assert not res.ok and "aux layers" in res.message
    assert engine.head_version == "v1"
    got = engine.generate([3, 4, 5], SamplingParams(max_tokens=12))
    assert got.trace.head_version == "v1" and got.token_ids == plain_greedy(target, [3, 4, 5], 12)[: len(got.token_ids)]


def test_swap_to_plain_decoding_and_back():
    target, v1 = tiny_setup(seed=2)
    engine = SpeculativeEngine(target, v1, EngineConfig(**FIXED), head_version="v1")
    assert engine.set_head(None).ok and engine.head is None
    plain = engine.generate([6, 7, 8], SamplingParams(max_tokens=10))
    assert plain.trace.head_version is None and all(s.tree_size == 0 for s in plain.steps)
    assert engine.set_head(v1, "v1").ok and engine.generate([6, 7, 8], SamplingParams(max_tokens=10)).token_ids == \
        plain.token_ids


def test_prepared_head_shares_the_target_embedding_and_leaves_the_given_head_alone():
    target, head = tiny_setup(seed=3)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    prepared = prepare_head(head, target)
    assert prepared.embed_tokens.weight.data_ptr() == target.input_embeddings().data_ptr()
    assert prepared is not head and prepared.fc.weight.data_ptr() != head.fc.weight.data_ptr()
    for k, v in head.state_dict().items():
        assert torch.equal(v, before[k]), k
    check_head(prepared, target)



def test_an_adopted_head_is_prepared_in_place_and_a_prepared_binding_installs_by_a_flip():
    """adopt: a head handed over (loaded for this engine alone) is prepared without a copy of its weights; a
    binding prepared earlier installs as it is; one prepared for another compute mode is refused."""
    from dataclasses import replace

    target, v1 = tiny_setup(seed=3)
    engine = SpeculativeEngine(target, v1, EngineConfig(**FIXED), head_version="v1")
    engine.eos_ids = set()
    head = other_head(target, 7)
    fc = head.fc.weight.data_ptr()
    binding = engine.bind(head, "v2", adopt=True)
    assert binding.head is head and head.fc.weight.data_ptr() == fc
    assert head.embed_tokens.weight.data_ptr() == target.input_embeddings().data_ptr()
    prompt, sp = [4, 8, 15, 16], SamplingParams(max_tokens=16)
    old = engine.binding
    res = engine.set_head(binding)
    assert res.ok and engine.binding is binding and engine.head_version == "v2"
    assert engine.generate(prompt, sp).token_ids == plain_greedy(target, prompt, 16)
    assert engine.set_head(old).ok and engine.binding is old  # back: a flip too
    foreign = replace(binding, compute="some-other-mode")
    refused = engine.set_head(foreign)
    assert not refused.ok and "compute" in refused.message and engine.binding is old

def test_swaps_from_another_thread_never_break_requests_in_flight():
    target, v1 = tiny_setup(seed=4)
    heads = [v1, other_head(target, 11), other_head(target, 12)]
    engine = SpeculativeEngine(target, v1, EngineConfig(depth=3, topk=2, num_draft_tokens=6, calibration_dir=""),
                               head_version="h0")
    engine.eos_ids = set()
    stop = threading.Event()
    results = []

    def swapper():
        i = 0
        while not stop.is_set():
            i += 1
            assert engine.set_head(heads[i % 3], f"h{i % 3}").ok

    t = threading.Thread(target=swapper)
    t.start()
    try:
        for k in range(6):
            prompt = [3 + k, 9, 4 + k]
            res = engine.generate(prompt, SamplingParams(max_tokens=16))
            results.append(res.head_version)
            assert res.token_ids == plain_greedy(target, prompt, 16)
    finally:
        stop.set()
        t.join()
    assert all(v in ("h0", "h1", "h2") for v in results)


def test_calibration_is_persisted_and_reloaded_with_the_head(tmp_path):
    target, head = tiny_setup(seed=5)
    # pinned costs: whether the head drafts (and so what gets observed) must not depend on this machine's load
    cfg = EngineConfig(depth=3, topk=2, num_draft_tokens=6, calibration_dir=str(tmp_path), pinned_costs=PINNED)
    a = SpeculativeEngine(target, head, cfg, head_version="v7")
    assert a.binding.calibration_source == "prior"
    for k in range(3):
        a.generate([4 + k, 5, 6, 7], SamplingParams(max_tokens=16))
    assert a.calibration.observations > 0
    assert a.save_calibration()
    b = SpeculativeEngine(target, head, cfg, head_version="v7")
    assert b.binding.calibration_source == "cache"
    assert b.calibration.to_dict() == a.calibration.damped().to_dict()  # reloaded, weighted to yield to live data
    # another version, or the same version on another compute mode, starts from its own
    assert SpeculativeEngine(target, head, cfg, head_version="v8").binding.calibration_source == "prior"
    # a corrupt file is refused (counted), never trusted
    (path,) = list(tmp_path.glob("*.json"))
    path.write_text(json.dumps({"head_version": "v7", "target_fingerprint": target.fingerprint, "compute": "",
                                "calibration": {"format": 1, "eagle": {"offered": [-1]}}}))
    c = SpeculativeEngine(target, head, cfg, head_version="v7")
    assert c.binding.calibration_source == "prior" and c.calibrations.refused == 1


def test_calibration_seeded_from_head_json_metrics(tmp_path):
    from adaptive_eagle.checkpoint import HeadMeta, LoadedHead

    target, head = tiny_setup(seed=6)
    seed = AcceptCalibration()
    seed.observe_eagle([0.9] * 50, [False] * 50)
    meta = HeadMeta.new("v-shipped", "tiny", target.fingerprint, metrics={"calibration": {
        target.fingerprint: seed.to_dict()}})
    engine = SpeculativeEngine(target, LoadedHead(head, meta, head.cfg),
                               EngineConfig(calibration_dir=str(tmp_path)))
    assert engine.head_version == "v-shipped" and engine.binding.calibration_source == "head.json"
    assert float(engine.calibration.eagle(torch.tensor([0.9]))[0]) < 0.1


def test_calibration_store_writes_nothing_without_a_version_or_a_root(tmp_path):
    store = CalibrationStore(tmp_path)
    assert not store.save(HeadBinding(None, None), "fp")
    assert not CalibrationStore(None).save(HeadBinding(object(), "v"), "fp")
    assert list(tmp_path.iterdir()) == []


def test_calibration_dict_roundtrip_and_refusals():
    cal = AcceptCalibration()
    cal.observe_eagle([0.3, 0.9], [True, False])
    cal.observe_suffix([0.7], [True])
    cal.observe_lookup(4, 2)
    again = AcceptCalibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert again.to_dict() == cal.to_dict()
    with pytest.raises(ValueError, match="format"):
        AcceptCalibration.from_dict({"format": 99})
    bad = cal.to_dict()
    bad["eagle"]["accepted"][0] = 5.0
    with pytest.raises(ValueError, match="eagle"):
        AcceptCalibration.from_dict(bad)


def test_set_head_refuses_what_is_not_a_head_without_raising():
    target, v1 = tiny_setup(seed=7)
    engine = SpeculativeEngine(target, v1, EngineConfig(**FIXED), head_version="v1")
    res = engine.set_head("heads/some-dir", "v9")
    assert not res.ok and "Eagle3DraftHead" in res.message and engine.head_version == "v1"


def test_a_head_installed_into_a_plain_engine_gets_the_verify_cost_measured_by_the_next_request():
    target, v1 = tiny_setup(seed=8)
    engine = SpeculativeEngine(target, None, EngineConfig.plain())
    assert not engine.verify_cost.points
    assert engine.set_head(v1, "v1").ok and not engine.verify_cost.points  # nothing timed on the caller's thread
    res = engine.generate([3, 4, 5], SamplingParams(max_tokens=8))
    assert engine.verify_cost.points and res.head_version == "v1"


def test_a_carried_over_calibration_keeps_its_rates_but_yields_to_live_evidence():
    cal = AcceptCalibration()
    cal.observe_eagle([0.6] * 1000, [True] * 300 + [False] * 700)
    for _ in range(400):
        cal.observe_lookup(4, 4)  # traffic that copied a lot
    d = cal.damped()
    assert abs(float(d.eagle(torch.tensor([0.6]))[0]) - float(cal.eagle(torch.tensor([0.6]))[0])) < 0.03  # only the prior weighs more
    assert max(d.eagle_buckets.offered) <= 50 and max(d.lookup_tries) <= 8
    for _ in range(20):  # this request does not copy
        d.observe_lookup(4, 0)
        cal.observe_lookup(4, 0)
    assert d.lookup(1) < 0.4 < cal.lookup(1)  # the damped one noticed within 20 steps; the raw one did not


def test_a_prepared_binding_decodes_one_request_without_being_installed():
    target, head = tiny_setup(seed=2)
    engine = SpeculativeEngine(target, head, EngineConfig(**FIXED), head_version="v1")
    engine.eos_ids = set()
    canary = engine.bind(other_head(target, 5), "v2")
    prompt = [3, 4, 5, 6]
    want = plain_greedy(target, prompt, 20)
    got = engine.generate(prompt, SamplingParams(max_tokens=20), binding=canary)
    assert got.token_ids == want and got.head_version == "v2" and engine.head_version == "v1"
    assert engine.generate(prompt, SamplingParams(max_tokens=20)).head_version == "v1"
    with pytest.raises(GenerationError, match="vocab|hidden|aux"):
        bad = other_head(target, 6)
        bad.cfg = bad.cfg.__class__(**{**bad.cfg.__dict__, "aux_layer_ids": (1, 2, 3)})
        engine.bind(bad, "bad")
