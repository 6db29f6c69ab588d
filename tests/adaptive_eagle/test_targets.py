"""The aux-layer convention (id k = INPUT of decoder layer k), target directories and fingerprints,
and the facts of the built-in SmolLM2 target."""

import json
import shutil

import pytest
import torch

from adaptive_eagle.compute import choose_mode, mode_of
from adaptive_eagle.targets import (
    default_aux_layer_ids,
    fingerprint_dir,
    from_sglang_config_layer_ids,
    load_target,
    resolve_target_path,
    sglang_config_layer_ids,
    target_features,
    tiny_target,
)


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(seed=0, num_layers=8)  # default aux ids (2, 4, 5): three distinct layers


def layer_inputs(model, layer_ids, input_ids):
    """Capture the hidden-state input of each decoder layer in `layer_ids` with forward pre-hooks."""
    captured = {}

    def hook_for(k):
        def hook(module, args, kwargs):
            captured[k] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        return hook

    handles = [model.model.layers[k].register_forward_pre_hook(hook_for(k), with_kwargs=True) for k in layer_ids]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in handles:
            h.remove()
    return captured


# ---- the convention, on a tiny Llama -----------------------------------------------------------
def test_aux_features_are_hidden_states_and_layer_inputs(tiny):
    ids = torch.randint(3, tiny.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    assert tiny.aux_layer_ids == (2, 4, 5)
    with torch.no_grad():
        hs = tiny.model(ids, output_hidden_states=True).hidden_states
    assert len(hs) == tiny.num_layers + 1
    feats = tiny.features(ids)
    h = tiny.config.hidden_size
    assert feats.aux.shape == (2, 11, 3 * h)
    torch.testing.assert_close(feats.aux, torch.cat([hs[k] for k in tiny.aux_layer_ids], dim=-1), rtol=0, atol=0)
    inputs = layer_inputs(tiny.model, tiny.aux_layer_ids, ids)
    for i, k in enumerate(tiny.aux_layer_ids):
        torch.testing.assert_close(inputs[k], hs[k], rtol=0, atol=0)  # "id k = input of layer k"
        torch.testing.assert_close(feats.aux[..., i * h : (i + 1) * h], inputs[k], rtol=0, atol=0)


def test_every_layer_id_names_that_layers_input(tiny):
    ids = torch.randint(3, tiny.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = tiny.model(ids, output_hidden_states=True).hidden_states
    inputs = layer_inputs(tiny.model, range(tiny.num_layers), ids)
    for k in range(tiny.num_layers):  # index 0 = embedding output = input of layer 0
        torch.testing.assert_close(inputs[k], hs[k], rtol=0, atol=0)
    feats = target_features(tiny.model, ids, None, (1, 3, 7))
    torch.testing.assert_close(feats.aux, torch.cat([inputs[1], inputs[3], inputs[7]], dim=-1), rtol=0, atol=0)


def test_features_last_is_after_the_final_norm(tiny):
    ids = torch.randint(3, tiny.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    captured = {}
    handle = tiny.model.model.layers[-1].register_forward_hook(
        lambda m, a, out: captured.setdefault("out", out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            out = tiny.model(ids, output_hidden_states=True)
    finally:
        handle.remove()
    feats = tiny.features(ids)
    torch.testing.assert_close(feats.last, out.hidden_states[-1], rtol=0, atol=0)
    torch.testing.assert_close(feats.last, tiny.model.model.norm(captured["out"]), rtol=0, atol=0)
    # and it is the LM-head input
    torch.testing.assert_close(feats.last @ tiny.output_embeddings().T, out.logits, rtol=1e-5, atol=1e-5)


def test_default_and_sglang_layer_ids():
    assert default_aux_layer_ids(30) == (2, 15, 27)
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert default_aux_layer_ids(6) == (1, 3, 5) and default_aux_layer_ids(4) == (1, 2, 3)  # never colliding
    with pytest.raises(ValueError):
        default_aux_layer_ids(3)
    assert sglang_config_layer_ids((2, 15, 27)) == [1, 14, 26]
    assert from_sglang_config_layer_ids([1, 14, 26]) == (2, 15, 27)
    assert from_sglang_config_layer_ids(sglang_config_layer_ids((3, 9, 11))) == (3, 9, 11)


# ---- local directories and fingerprints ------------------------------------------------------------
# load_target needs a tokenizer in the directory (AutoTokenizer has nothing to build one from
# offline), so the fast tests pin resolve_target_path + fingerprint_dir; the slow test below
# borrows SmolLM2's tokenizer files to load a tiny local directory end to end.
@pytest.fixture
def saved_dir(tmp_path, tiny):
    d = tmp_path / "tiny-llama"
    tiny.model.save_pretrained(d)
    return d


def test_resolve_local_directory_and_fingerprint(saved_dir):
    assert resolve_target_path(str(saved_dir)) == saved_dir
    fp = fingerprint_dir(saved_dir)
    assert fp.startswith("sha256:") and len(fp) == len("sha256:") + 32
    assert fingerprint_dir(saved_dir) == fp  # stable
    # unrelated files do not count
    (saved_dir / "README.md").write_text("notes")
    assert fingerprint_dir(saved_dir) == fp


def test_fingerprint_changes_with_one_weight_byte(saved_dir):
    fp = fingerprint_dir(saved_dir)
    weights = saved_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # the tail of the file is tensor data
    weights.write_bytes(bytes(data))
    assert fingerprint_dir(saved_dir) != fp


def test_fingerprint_changes_with_config(saved_dir):
    fp = fingerprint_dir(saved_dir)
    cfg = json.loads((saved_dir / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (saved_dir / "config.json").write_text(json.dumps(cfg))
    assert fingerprint_dir(saved_dir) != fp


def test_directory_without_config_is_refused(tmp_path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        resolve_target_path(str(empty))
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        resolve_target_path("some-org/some-hub-model")
    with pytest.raises(FileNotFoundError):
        fingerprint_dir(empty)


@pytest.mark.slow
def test_load_local_directory_with_a_tokenizer(saved_dir):
    src = resolve_target_path("smollm2-135m")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, saved_dir / name)
    t = load_target(str(saved_dir), dtype=torch.float32)
    assert t.path == saved_dir and t.num_layers == 8 and t.dtype == torch.float32
    assert t.fingerprint == fingerprint_dir(saved_dir)
    assert t.aux_layer_ids == (2, 4, 5)
    assert not any(p.requires_grad for p in t.model.parameters())
    assert load_target(str(saved_dir), aux_layer_ids=(1, 3, 7)).aux_layer_ids == (1, 3, 7)
    for bad in ((0, 3, 5), (2, 4, 8)):
        with pytest.raises(ValueError, match="aux layer ids"):
            load_target(str(saved_dir), aux_layer_ids=bad)


# ---- the real SmolLM2-135M-Instruct --------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_facts(smollm2):
    c = smollm2.config
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size) == (30, 576, 49152)
    # decoding defaults to the fastest EXACT mode measured here (fp32 math), never bf16. Which exact mode is
    # fastest is a timing of this machine under its current load: the test checks that the choice follows
    # the measured table, not which mode won
    assert smollm2.exact and smollm2.dtype == torch.float32
    assert smollm2.compute in ("float32", "float32+fp16-weights")
    choice = smollm2.compute_choice
    if choice.table is not None:
        assert mode_of(smollm2.compute) == choose_mode(choice.table)
    assert smollm2.aux_layer_ids == (2, 15, 27)
    assert sglang_config_layer_ids(smollm2.aux_layer_ids) == [1, 14, 26]
    assert smollm2.fingerprint.startswith("sha256:")
    assert smollm2.fingerprint == fingerprint_dir(smollm2.path)  # the cached marker is the content hash


@pytest.mark.slow
def test_smollm2_chat_template_and_greedy_answer(smollm2):
    tok = smollm2.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = smollm2.model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1] :])
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_smollm2_aux_convention(smollm2):
    ids = smollm2.tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hs = smollm2.model(ids, output_hidden_states=True).hidden_states
    assert len(hs) == 31
    inputs = layer_inputs(smollm2.model, (15,), ids)
    torch.testing.assert_close(inputs[15], hs[15], rtol=0, atol=0)
    feats = smollm2.features(ids)
    h = smollm2.config.hidden_size
    assert feats.aux.shape == (1, ids.shape[1], 3 * h)
    torch.testing.assert_close(feats.aux[..., h : 2 * h], inputs[15], rtol=0, atol=0)
    torch.testing.assert_close(feats.last, hs[-1], rtol=0, atol=0)


def test_fingerprint_ignores_how_the_directory_was_written(saved_dir):
    """A newer transformers writing the same weights must not change the target's identity."""
    fp = fingerprint_dir(saved_dir)
    cfg = json.loads((saved_dir / "config.json").read_text())
    cfg["transformers_version"] = "9.99.0"
    cfg["_name_or_path"] = "/somewhere/else"
    (saved_dir / "config.json").write_text(json.dumps(cfg))
    assert fingerprint_dir(saved_dir) == fp


def test_kernels_held_to_avx2_have_no_hardware_bf16_whatever_the_cpu_flags_say():
    """`CPU_ISA=avx2` runs an AVX2-only CPU's kernels on an AVX-512 machine; the trainer must then train in fp32
    as it would there (bf16 GEMMs without AVX512-BF16 are 5-8x slower), not read /proc/cpuinfo's flags."""
    import os
    import subprocess
    import sys

    code = "from adaptive_eagle.targets import cpu_has_fast_bf16; print(cpu_has_fast_bf16())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
