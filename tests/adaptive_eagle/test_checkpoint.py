"""Head checkpoints: bit-exact round trips, SGLang / speculators layouts, and every refusal."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from adaptive_eagle.checkpoint import (
    MOE_ARCH,
    SGLANG_ARCH,
    HeadMeta,
    HeadValidationError,
    file_sha256,
    load_head,
    read_config,
    save_head,
    upgrade_config,
)
from adaptive_eagle.draft_head import DraftHeadConfig, Eagle3DraftHead, check_aux_layer_ids, init_weights
from adaptive_eagle.interop import export_speculators, import_specforge
from adaptive_eagle.targets import tiny_target

DRAFT_VOCAB = 40


def tiny(**kw):
    """8 layers: default aux ids (2, 4, 5) are distinct (6 layers would give (2, 3, 3))."""
    return tiny_target(num_layers=8, **kw)


@pytest.fixture(scope="module")
def target():
    return tiny()


def make_head(target, num_experts=1, seed=0):
    torch.manual_seed(seed)
    cfg = DraftHeadConfig.from_target(
        target.config, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=target.aux_layer_ids, num_experts=num_experts
    )
    head = Eagle3DraftHead(cfg)
    init_weights(head)
    head.set_draft_vocab(torch.randperm(cfg.vocab_size)[:DRAFT_VOCAB].sort().values)
    return head


def meta_for(target, version="v1"):
    return HeadMeta.new(version, target.name, target.fingerprint, data={"tokens": 123}, training={"lr": 1e-4})


@pytest.fixture
def saved(tmp_path, target):
    head = make_head(target)
    d = tmp_path / "v1"
    save_head(head, d, meta_for(target), dtype=torch.float32)
    return head, d


def trainable_state(head):
    return {k: v for k, v in head.state_dict().items() if k != "embed_tokens.weight"}


def assert_same_weights(a, b, dtype=None):
    sa, sb = trainable_state(a), trainable_state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        x = sa[k].to(dtype) if dtype is not None and sa[k].is_floating_point() else sa[k]
        assert x.dtype == sb[k].dtype and torch.equal(x, sb[k]), k


def rewrite_tensors(d: Path, fn):
    """Apply fn to the tensors of d/model.safetensors and re-pin the sha256 so later checks are reached."""
    tensors = load_file(str(d / "model.safetensors"))
    out = fn(tensors)  # mutates in place, or returns a new dict
    save_file(out if isinstance(out, dict) else tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    repin(d)


def repin(d: Path):
    meta = json.loads((d / "head.json").read_text())
    meta["sha256"] = file_sha256(d / "model.safetensors")
    (d / "head.json").write_text(json.dumps(meta))


def edit_config(d: Path, fn):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def set_aux(ids):
    def fn(cfg):
        cfg["adaptive_eagle"]["aux_layer_ids"] = ids
        cfg["eagle_aux_hidden_state_layer_ids"] = ids
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [k - 1 for k in ids]

    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts", [1, 3])
def test_round_trip_bit_exact(tmp_path, target, dtype, experts):
    head = make_head(target, num_experts=experts)
    meta = save_head(head, tmp_path / "v1", meta_for(target), dtype=dtype)
    assert meta.sha256 == file_sha256(tmp_path / "v1" / "model.safetensors") and meta.created.endswith("Z")
    loaded = load_head(tmp_path / "v1", target)
    assert loaded.config == head.cfg and loaded.meta == meta and loaded.meta.data == {"tokens": 123}
    assert_same_weights(head, loaded.head, dtype)
    assert torch.equal(loaded.head.d2t, head.d2t) and torch.equal(loaded.head.t2d, head.t2d)
    emb = loaded.head.embed_tokens.weight
    assert not emb.requires_grad and torch.equal(emb, target.input_embeddings().to(dtype))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]  # no staging leftovers


def test_a_head_loaded_to_draft_shares_the_targets_embeddings_and_is_built_without_random_init(saved, target):
    head, d = saved
    copied = load_head(d, target)
    shared = load_head(d, target, share_embeddings=True)
    emb = target.input_embeddings()
    assert copied.head.embed_tokens.weight.data_ptr() != emb.data_ptr()
    assert shared.head.embed_tokens.weight.data_ptr() == emb.data_ptr()  # no copy for a head that only drafts
    assert_same_weights(head, shared.head)
    # the layout is built on the meta device: every tensor of the result comes from the file or the target
    assert all(t.device.type == "cpu" for t in [*shared.head.parameters(), *shared.head.buffers()])
    assert torch.equal(shared.head.d2t, head.d2t) and torch.equal(shared.head.t2d, head.t2d)
    assert [n for n, p in shared.head.named_parameters() if p.requires_grad] == \
        [n for n, p in head.named_parameters() if p.requires_grad]


def test_all_finite_decides_exactly():
    from adaptive_eagle.draft_head import all_finite

    x = torch.randn(64, 32)
    assert all_finite(x) and all_finite(x.bfloat16())
    big = torch.full((64, 32), 3e38)  # finite, but its float32 sum overflows: the exact check decides
    assert all_finite(big)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[7, 3] = bad
        assert not all_finite(y) and not all_finite(y.bfloat16())


def test_versions_are_immutable_and_finite(saved, target):
    head, d = saved
    with pytest.raises(FileExistsError, match="immutable"):
        save_head(head, d, meta_for(target))
    save_head(make_head(target, seed=1), d, meta_for(target), dtype=torch.float32, overwrite=True)
    assert not torch.equal(load_head(d).head.fc.weight, head.fc.weight)
    with torch.no_grad():
        head.fc.weight[0, 0] = 1e5  # finite in float32, inf in float16: refused before anything is written
    with pytest.raises(HeadValidationError, match="'fc.weight' has non-finite"):
        save_head(head, d.parent / "v2", meta_for(target), dtype=torch.float16)
    assert sorted(p.name for p in d.parent.iterdir()) == ["v1"]


def test_sglang_config_and_file_layout(tmp_path, target):
    head = make_head(target)
    save_head(head, tmp_path / "v", meta_for(target))  # default bf16
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_act"] == "silu" and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == 128 and cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["target_hidden_size"] == 64
    assert cfg["torch_dtype"] == "bfloat16" and cfg["rope_scaling"] is None and cfg["head_dim"] == 16
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    assert cfg["adaptive_eagle"]["aux_layer_ids"] == [2, 4, 5] == list(target.aux_layer_ids)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # top level, for vLLM: ours, no -1
    assert read_config(tmp_path / "v") == head.cfg
    with safe_open(str(tmp_path / "v" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
        assert keys == set(trainable_state(head)) and "embed_tokens.weight" not in keys
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16


def test_moe_head_is_not_loadable_as_sglangs_dense_head(tmp_path, target):
    save_head(make_head(target), tmp_path / "dense", meta_for(target))
    save_head(make_head(target, num_experts=3), tmp_path / "moe", meta_for(target))
    dense = json.loads((tmp_path / "dense" / "config.json").read_text())
    moe = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert dense["architectures"] == [SGLANG_ARCH] == ["LlamaForCausalLMEagle3"]
    # SGLang resolves architectures by exact class name; this one is registered by neither SGLang nor vLLM
    assert moe["architectures"] == [MOE_ARCH] and not any("LlamaForCausalLMEagle3" == a for a in moe["architectures"])
    assert "auto_map" not in moe  # nothing for a Transformers fallback to load instead
    assert load_head(tmp_path / "moe", target).config.num_experts == 3  # our loader takes both names


def test_format_1_moe_head_under_the_dense_name_is_upgraded(tmp_path, target):
    head = make_head(target, num_experts=3)
    d = tmp_path / "old-moe"
    save_head(head, d, meta_for(target), dtype=torch.float32)

    def to_format_1(c):
        c.update(architectures=[SGLANG_ARCH])
        c.pop("eagle_aux_hidden_state_layer_ids")
        c["adaptive_eagle"]["format_version"] = 1

    edit_config(d, to_format_1)
    assert upgrade_config(json.loads((d / "config.json").read_text()))["architectures"] == [MOE_ARCH]
    assert_same_weights(head, load_head(d, target).head)
    edit_config(d, lambda c: c["adaptive_eagle"].update(format_version=2))  # a current file cannot do this
    with pytest.raises(HeadValidationError, match=r"config\.json: architectures \['LlamaForCausalLMEagle3'\] with "
                                                  r"adaptive_eagle\.num_experts 3: a MoE head must be"):
        load_head(d, target)


def test_aux_ids_must_be_strictly_ascending_and_unique(tmp_path, target):
    assert check_aux_layer_ids([2, 4, 5]) == (2, 4, 5)
    for bad in ([2, 4, 4], [4, 2, 5], [3, 3]):
        with pytest.raises(ValueError, match=r"aux_layer_ids .* must be strictly ascending and unique"):
            check_aux_layer_ids(bad)
    head = make_head(target)
    object.__setattr__(head.cfg, "aux_layer_ids", (2, 5, 4))  # a config made before the rule existed
    with pytest.raises(HeadValidationError, match=r"head being saved\): aux_layer_ids \[2, 5, 4\] must be strictly"):
        save_head(head, tmp_path / "v", meta_for(target))
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize("name", ["smollm2-135m-english-v1", "smollm2-135m-english-v2"])
def test_shipped_heads_without_the_top_level_ids_still_load(name):
    d = Path(__file__).resolve().parents[2] / "heads" / name
    assert "eagle_aux_hidden_state_layer_ids" not in json.loads((d / "config.json").read_text())
    assert read_config(d).aux_layer_ids == (2, 15, 27)
    assert load_head(d).config.num_experts == 1


def _flip_byte(d):
    data = bytearray((d / "model.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (d / "model.safetensors").write_bytes(bytes(data))


def _truncate(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    repin(d)


def _nan(t):
    t["fc.weight"][0, 0] = float("nan")


def on_tensors(fn):
    return lambda d: rewrite_tensors(d, fn)


def on_config(fn):
    return lambda d: edit_config(d, fn)


def lm_head_short(t):
    t["lm_head.weight"] = t["lm_head.weight"][:-1]


REFUSALS = [  # (id, mutate the saved dir or None, target factory or None, message pattern)
    ("checksum", _flip_byte, None, r"model\.safetensors: sha256 mismatch"),
    ("truncated", _truncate, None, r"model\.safetensors: unreadable safetensors"),
    ("nan", on_tensors(_nan), None, r"'fc\.weight' has non-finite"),
    ("missing", on_tensors(lambda t: t.pop("norm.weight")), None, r"missing tensors \['norm\.weight'\]"),
    ("extra", on_tensors(lambda t: t.update(bogus=torch.zeros(2))), None, r"unexpected tensors \['bogus'\]"),
    ("shape", on_tensors(lm_head_short), None, r"'lm_head\.weight' has shape \[39, 64\]"),
    ("vocab-map", on_tensors(lambda t: t["t2d"].fill_(True)), None, r"t2d marks 128"),
    ("malformed-config", lambda d: (d / "config.json").write_text("{not json"), None, r"config\.json: malformed JSON"),
    ("config-range", on_config(lambda c: c.update(rms_norm_eps=-1.0)), None, r"config\.json: rms_norm_eps"),
    ("aux-disagree", on_config(lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 5])),
     None, r"disagree"),
    ("aux-top-level-disagree", on_config(lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 4])), None,
     r"config\.json: eagle_aux_hidden_state_layer_ids \(top level, read by vLLM as is\) = \[1, 3, 4\] disagree"),
    ("aux-duplicate", on_config(set_aux([2, 4, 4])), None,
     r"config\.json: adaptive_eagle\.aux_layer_ids \[2, 4, 4\] must be strictly ascending and unique"),
    ("aux-unsorted", on_config(set_aux([4, 2, 5])), None, r"\[4, 2, 5\] must be strictly ascending"),
    ("moe-name-on-dense", on_config(lambda c: c.update(architectures=[MOE_ARCH])), None,
     r"config\.json: architectures \['AdaptiveEagleMoEForCausalLMEagle3'\] names a MoE head but "
     r"adaptive_eagle\.num_experts is 1"),
    ("missing-meta", lambda d: (d / "head.json").unlink(), None, r"head\.json: missing"),
    ("vocab", None, lambda: tiny(vocab_size=256), r"config\.json: vocab_size 128 != target"),
    ("hidden", None, lambda: tiny(hidden_size=32), r"target_hidden_size 64 != target hidden_size 32"),
    ("aux-ids", on_config(set_aux([1, 2, 4])), tiny, r"aux layer ids \[1, 2, 4\] != the target's"),
    ("aux-range", on_config(set_aux([2, 3, 9])), tiny, r"aux layer ids \[9\] out of range 1\.\.7"),
    ("fingerprint", None, lambda: tiny(seed=1), r"head\.json: target fingerprint"),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_refused(saved, case):
    _, mutate, make_target, pattern = case
    _, d = saved
    if mutate is not None:
        mutate(d)
    with pytest.raises(HeadValidationError, match=pattern):
        load_head(d, make_target() if make_target else None)


def test_fingerprint_override_and_checksum_skip(saved):
    head, d = saved
    other = tiny(seed=1)  # same shapes, other weights
    assert_same_weights(head, load_head(d, other, allow_fingerprint_mismatch=True).head)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["fc.weight"][0, 0] += 1.0
    save_file(tensors, str(d / "model.safetensors"))  # sha256 in head.json now stale
    with pytest.raises(HeadValidationError, match="sha256 mismatch"):
        load_head(d)
    assert torch.equal(load_head(d, verify_checksum=False).head.fc.weight, tensors["fc.weight"])


def test_alternative_prefixes_load(saved, target):
    head, d = saved
    rename = lambda k: "model.layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k  # noqa: E731
    rewrite_tensors(d, lambda t: {rename(k): v for k, v in t.items()})
    assert_same_weights(head, load_head(d, target).head)


def test_config_without_aux_ids_needs_target(saved, target):
    head, d = saved
    edit_config(d, lambda c: [c.pop(k) for k in ("eagle_config", "adaptive_eagle", "eagle_aux_hidden_state_layer_ids")])
    with pytest.raises(HeadValidationError, match=r"config\.json: no aux layer ids.*pass the target"):
        read_config(d)
    assert read_config(d, target) == head.cfg  # SGLang default [2, L//2, L-3] == the target's
    assert_same_weights(head, load_head(d, target).head)


def test_upgrade_config_old_sglang_layout():
    old = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "vocab_size": 128, "draft_vocab_size": 32,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}
    new = upgrade_config(old)
    assert new["adaptive_eagle"]["aux_layer_ids"] == [2, 3, 4] and new["num_key_value_heads"] == 4
    assert new["head_dim"] == 16 and new["target_hidden_size"] == 64 and new["adaptive_eagle"]["num_experts"] == 1
    assert upgrade_config(new) == new  # idempotent
    with pytest.raises(HeadValidationError, match="not an EAGLE-3 head"):
        upgrade_config({**old, "architectures": ["LlamaForCausalLM"]})
    spec = {"speculators_model_type": "eagle3", "draft_vocab_size": 32, "eagle_aux_hidden_state_layer_ids": [2, 3, 4],
            "transformer_layer_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                         "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 128}}
    up = upgrade_config(spec)  # to_diff_dict style: kv heads, eps, theta come from LlamaConfig defaults
    assert up["adaptive_eagle"]["aux_layer_ids"] == [2, 3, 4] and up["num_key_value_heads"] == 4
    assert up["rms_norm_eps"] == 1e-6 and up["rope_theta"] == 10000.0 and up["target_hidden_size"] == 64


def test_speculators_export_round_trip(saved, target, tmp_path):
    head, d = saved
    out = export_speculators(d, tmp_path / "spec", target=target, verifier_name_or_path="tiny-target")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["target_hidden_size"] == 64
    assert cfg["norm_before_residual"] is False and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # no -1
    assert "eagle_aux_hidden_state_layer_ids" not in cfg["transformer_layer_config"]
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                       "accept_tolerance": 0.0}]
    assert sc["verifier"] == {"name_or_path": "tiny-target", "architectures": ["LlamaForCausalLM"]}
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["vocab_size"] == 128 and layer["num_hidden_layers"] == 1
    keys = set(load_file(str(out / "model.safetensors")))
    assert {"layers.0.self_attn.q_proj.weight", "fc.weight", "lm_head.weight", "norm.weight", "d2t", "t2d"} <= keys
    assert not any(k.startswith("midlayer.") or k.startswith("embed") for k in keys)
    meta = import_specforge(out, tmp_path / "back", target, version="from-spec")
    assert meta.data["source_layout"] == "speculators" and meta.target_fingerprint == target.fingerprint
    back = load_head(tmp_path / "back", target)
    assert back.config == head.cfg
    assert_same_weights(head, back.head)
    moe_dir = tmp_path / "moe"
    save_head(make_head(target, num_experts=3), moe_dir, meta_for(target))
    with pytest.raises(ValueError, match="dense MLP"):
        export_speculators(moe_dir, tmp_path / "spec-moe")


def write_specforge_dir(src: Path, head, target):
    """A SpecForge-trained checkpoint: SGLang config without eagle_config, embed_tokens saved, fp32."""
    c = head.cfg
    src.mkdir()
    (src / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "torch_dtype": "float32", "tie_word_embeddings": False,
    }))
    state = {k: v.clone() for k, v in head.state_dict().items()}
    state["embed_tokens.weight"] = torch.randn(c.vocab_size, c.hidden_size)  # SpecForge's own copy: dropped
    save_file(state, str(src / "model.safetensors"))


def test_specforge_import(tmp_path, target):
    head = make_head(target, seed=3)
    write_specforge_dir(tmp_path / "sf", head, target)
    meta = import_specforge(tmp_path / "sf", tmp_path / "reg" / "imported", target, version="imported")
    assert meta.parent is None and meta.version == "imported" and meta.data["imported_from"] == str(tmp_path / "sf")
    loaded = load_head(tmp_path / "reg" / "imported", target)
    assert loaded.config == head.cfg and loaded.meta == meta
    assert_same_weights(head, loaded.head)
    assert torch.equal(loaded.head.embed_tokens.weight, target.input_embeddings())  # the target's, not the file's
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "reg" / "imported" / "model.safetensors"))


def test_specforge_import_refusals(tmp_path, target):
    head = make_head(target)
    write_specforge_dir(tmp_path / "sf", head, target)
    with pytest.raises(HeadValidationError, match="pass the target"):
        import_specforge(tmp_path / "sf", tmp_path / "out")
    (tmp_path / "sf" / "model.safetensors").unlink()
    torch.save({"fc.weight": torch.zeros(1)}, tmp_path / "sf" / "pytorch_model.bin")
    with pytest.raises(HeadValidationError, match="pickle checkpoints are not loaded; convert to safetensors"):
        import_specforge(tmp_path / "sf", tmp_path / "out", target)
    assert not (tmp_path / "out").exists()


def test_update_metrics_merges_and_keeps_checksum(tmp_path):
    from adaptive_eagle.checkpoint import update_metrics

    target = tiny()
    cfg = DraftHeadConfig.from_target(target.config, draft_vocab_size=64, aux_layer_ids=target.aux_layer_ids)
    head = Eagle3DraftHead(cfg)
    init_weights(head)
    meta = save_head(head, tmp_path / "v1", HeadMeta.new("v1", "tiny", target.fingerprint, metrics={"a": 1}))
    new = update_metrics(tmp_path / "v1", {"heldout": {"alpha": [0.5]}})
    assert new.metrics == {"a": 1, "heldout": {"alpha": [0.5]}} and new.sha256 == meta.sha256
    assert load_head(tmp_path / "v1", target).meta.metrics["heldout"]["alpha"] == [0.5]
