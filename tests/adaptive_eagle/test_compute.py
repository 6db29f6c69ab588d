"""Compute modes: the pure choice from a timing table (exact by default), the table cached once and
refused when corrupt, and load_target's forced and measured modes on a tiny bf16 checkpoint."""

import json
import os

import pytest
import torch

from adaptive_eagle import compute as C
from adaptive_eagle.cpu_linear import fbgemm_fp16_available
from adaptive_eagle.targets import describe_compute, load_target, tiny_target


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Timings in these tests never depend on how busy the machine running them is."""
    monkeypatch.setattr(C, "machine_busy", lambda threshold=0.5: False)

DEVICE = os.environ.get("ADAPTIVE_EAGLE_TEST_DEVICE", "cpu")  # bench/gpu_check.sh sets cuda
SIZES = C.PROBE_SIZES


def row(one: float, per_token: float) -> dict[int, float]:
    """A forward that costs `one` ms for 1 token and `per_token` ms more per extra token."""
    return {q: one + per_token * (q - 1) for q in SIZES}


def packed_table(**rows) -> C.ComputeTable:
    """A table whose fp32-math modes passed the row-stability check (a measured table checks it: shape_check)."""
    return C.ComputeTable("cpu:test", "fp:test", torch.__version__, rows,
                          rows_stable={m: C.is_exact_mode(m) for m in rows}, verify_logit_diff={m: 0.0 for m in rows})


# ---- the choice (pure, table-driven) ---------------------------------------------------------------
CASES = [
    # (rows, purpose, allow_inexact, expected)
    ({"bf16": row(20, 0.5), "fp32": row(40, 0.5)}, "speculative", False, "fp32"),  # bf16 fastest, inexact
    ({"bf16": row(20, 0.5), "fp32": row(40, 0.5)}, "plain", False, "fp32"),
    ({"bf16": row(20, 0.5), "fp32": row(40, 0.5)}, "plain", True, "bf16"),  # only when asked for
    ({"bf16": row(20, 0.5), "fp32": row(40, 0.5), "fp32+fp16-weights": row(30, 0.5)}, "speculative", False,
     "fp32+fp16-weights"),
    ({"fp32": row(30, 0.3), "fp32+fp16-weights": row(36, 0.3)}, "speculative", False, "fp32"),
    # packed is cheaper for one token but steep; fp32 is flat: plain and speculative purposes differ
    ({"fp32": row(30, 1.5), "fp32+fp16-weights": row(25, 11.0)}, "plain", False, "fp32+fp16-weights"),
    ({"fp32": row(30, 1.5), "fp32+fp16-weights": row(25, 11.0)}, "speculative", False, "fp32"),
    ({"bf16": row(10, 0.1), "fp16": row(9, 0.1), "fp32": row(30, 0.5)}, "speculative", False, "fp32"),  # CUDA-like
    ({"bf16": row(10, 0.1), "fp16": row(9, 0.1), "fp32": row(30, 0.5)}, "speculative", True, "fp16"),
]


@pytest.mark.parametrize("rows,purpose,allow_inexact,expected", CASES)
def test_choose_mode_picks_the_fastest_exact_mode(rows, purpose, allow_inexact, expected):
    t = packed_table(**rows)
    assert C.choose_mode(t, purpose, allow_inexact=allow_inexact) == expected
    mode, reason = C.choose(t, purpose, allow_inexact)
    assert mode == expected and reason.startswith(expected) and purpose in reason


def test_choice_reason_names_the_faster_inexact_mode():
    _, reason = C.choose(packed_table(bf16=row(20, 0.5), fp32=row(40, 0.5)), "speculative")
    assert "bf16 would be faster but is not exact" in reason


def test_choice_refuses_bad_purpose_and_tables_without_exact_modes():
    with pytest.raises(ValueError, match="purpose"):
        C.choose_mode(packed_table(fp32=row(1, 1)), "serve")
    with pytest.raises(ValueError, match="no exact compute mode"):
        C.choose_mode(packed_table(bf16=row(1, 1)), "speculative")
    assert C.choose_mode(packed_table(bf16=row(1, 1)), "speculative", allow_inexact=True) == "bf16"


def test_speculative_score_uses_the_cost_model():
    flat = row(30, 0.0)  # verifying 16 nodes costs a one-token forward: the whole tree pays
    score, nodes = C.speculative_score(flat)
    assert nodes == len(C.REFERENCE_TREE.accept)
    assert score == pytest.approx((1 + sum(C.REFERENCE_TREE.accept)) / (30 * (1 + C.DRAFT_FRACTION)))
    steep = row(30, 60.0)  # one more token costs two forwards: nothing pays, the drafting is still spent
    assert C.speculative_score(steep) == (pytest.approx(1 / (30 * (1 + C.DRAFT_FRACTION))), 0)


def test_profile_from_head_alpha():
    p = C.profile_from_alpha([0.5, 0.4, 0.0, 0.9])
    assert p.accept == pytest.approx((0.5, 0.2)) and p.parents == (-1, 0) and p.depths == (1, 2)
    assert C.REFERENCE_TREE.depths[:8] == tuple(range(1, 9))
    with pytest.raises(ValueError):
        C.profile_from_alpha([0.0])


def test_labels_and_parsing():
    assert C.lossless_label("float32") == "exact" and C.lossless_label("float32+fp16-weights") == "exact"
    assert C.lossless_label("bfloat16") == "lossless up to bf16 rounding"
    assert C.lossless_label("fp16") == "lossless up to fp16 rounding"
    assert C.parse_compute("float32+fp16-weights") == "fp32+fp16-weights" and C.parse_compute("AUTO") == "auto"
    with pytest.raises(ValueError, match=r"compute must be one of auto, bf16, fp32, fp32\+fp16-weights, fp16"):
        C.parse_compute("int8")
    assert C.available_modes("cpu", "bfloat16", True) == ("bf16", "fp32", "fp32+fp16-weights")
    assert C.available_modes("cpu", "float32", True) == ("bf16", "fp32")  # fp16 would round fp32 weights
    assert C.available_modes("cpu", "bfloat16", False) == ("bf16", "fp32")
    assert C.available_modes("cuda", "bfloat16", True) == ("bf16", "fp16", "fp32")


def test_target_exactness_follows_its_compute():
    assert tiny_target(dtype=torch.float32, num_layers=4).exact
    t = tiny_target(dtype=torch.bfloat16, num_layers=4)
    assert not t.exact and t.lossless == "lossless up to bf16 rounding" and t.compute == "bfloat16"


# ---- the cached table ------------------------------------------------------------------------------
@pytest.fixture
def tiny_models():
    """make_model for cached_table: a tiny Llama per mode, counting the calls."""
    calls = []

    def make(mode):
        calls.append(mode)
        return tiny_target(seed=0, dtype=C.MODE_DTYPES[mode], num_layers=4).model.to(DEVICE)

    return make, calls


def test_table_is_measured_once_then_read_from_the_cache(tmp_path, tiny_models):
    make, calls = tiny_models
    t1, source, notes = C.cached_table(tmp_path, make, ("bf16", "fp32"), "cpu:test", "fp:tiny", reps=1)
    assert source == "measured" and notes == () and calls == ["bf16", "fp32"]
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == [f"{C.table_key('cpu:test', 'fp:tiny')}.json"]  # no temp file left
    assert set(t1.forward_ms) == {"bf16", "fp32"} and all(set(r) == set(SIZES) for r in t1.forward_ms.values())
    t2, source, _ = C.cached_table(tmp_path, make, ("bf16", "fp32"), "cpu:test", "fp:tiny", reps=1)
    assert source == "cache" and calls == ["bf16", "fp32"] and t2 == t1
    _, source, _ = C.cached_table(tmp_path, make, ("bf16", "fp32"), "cpu:test", "fp:tiny", reps=1, refresh=True)
    assert source == "measured" and len(calls) == 4 and len(list(tmp_path.iterdir())) == 1
    # another target, machine or torch version has its own key
    assert C.table_key("cpu:test", "fp:other") != C.table_key("cpu:test", "fp:tiny")
    assert C.table_key("cpu:test", "fp:tiny", "0.0") != C.table_key("cpu:test", "fp:tiny")


@pytest.mark.parametrize("corrupt,reason", [
    (lambda good: "{not json", "not JSON"),
    (lambda good: json.dumps({**good, "scheme": 99}), "scheme"),
    (lambda good: json.dumps({**good, "fingerprint": "fp:someone-else"}), "fingerprint"),
    (lambda good: json.dumps({**good, "forward_ms": {"fp32": good["forward_ms"]["fp32"]}}), "modes not measured: bf16"),
    (lambda good: json.dumps({**good, "forward_ms": {**good["forward_ms"], "fp32": {"1": -3.0}}}), "sizes"),
    (lambda good: json.dumps({**good, "forward_ms": {**good["forward_ms"], "int8": good["forward_ms"]["fp32"]}}),
     "unknown mode"),
    (lambda good: json.dumps({k: v for k, v in good.items() if k != "rows_stable"}), "rows_stable"),
    (lambda good: json.dumps({**good, "rows_stable": {"fp32": "yes", "bf16": False}}), "rows_stable"),
    (lambda good: json.dumps({**good, "verify_logit_diff": {"fp32": -1.0, "bf16": 0.0}}), "verify_logit_diff"),
    (lambda good: json.dumps({**good, "prefill_ms": {"fp32": 5.0}}), "prefill_ms"),
])
def test_corrupt_cache_is_refused_with_a_reason_and_remeasured(tmp_path, monkeypatch, corrupt, reason):
    calls = []
    make = calls.append  # the timing is faked here: this test is about the file
    monkeypatch.setattr(C, "time_forwards", lambda models, sizes, prefix, reps: {
        m: {q: 1.0 + q for q in sizes} for m in models})
    monkeypatch.setattr(C, "shape_check", lambda model: C.ShapeCheck(True, 0.0))
    monkeypatch.setattr(C, "time_prefills", lambda models, rows, reps: {m: 50.0 for m in models})
    C.cached_table(tmp_path, make, ("bf16", "fp32"), "cpu:test", "fp:tiny", reps=1)
    path = tmp_path / f"{C.table_key('cpu:test', 'fp:tiny')}.json"
    path.write_text(corrupt(json.loads(path.read_text())))
    with pytest.raises(C.ComputeTableError, match=reason):
        C.read_table(path, "cpu:test", "fp:tiny", ("bf16", "fp32"))
    table, source, notes = C.cached_table(tmp_path, make, ("bf16", "fp32"), "cpu:test", "fp:tiny", reps=1)
    assert source == "measured" and len(calls) == 4
    assert len(notes) == 1 and "refused" in notes[0] and reason in notes[0] and "re-measured" in notes[0]
    assert C.read_table(path, "cpu:test", "fp:tiny", ("bf16", "fp32")) == table  # rewritten, usable again


def test_time_forward_sizes(tiny_models):
    make, _ = tiny_models
    ms = C.time_forward(make("fp32"), sizes=(1, 4), prefix=8, reps=1)
    assert set(ms) == {1, 4} and all(v > 0 for v in ms.values())
    both = C.time_forwards({"fp32": make("fp32"), "bf16": make("bf16")}, sizes=(1, 2), prefix=8, reps=2)
    assert set(both) == {"fp32", "bf16"} and all(set(r) == {1, 2} for r in both.values())
    prefill = C.time_prefills({"fp32": make("fp32"), "bf16": make("bf16")}, rows=16, reps=1)
    assert set(prefill) == {"fp32", "bf16"} and all(v > 0 for v in prefill.values())


def test_a_table_timed_on_a_busy_machine_is_retimed_once_it_is_quiet(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(C, "time_forwards", lambda models, sizes, prefix, reps: {
        m: {q: 1.0 + q for q in sizes} for m in models})
    monkeypatch.setattr(C, "shape_check", lambda model: C.ShapeCheck(True, 0.0))
    monkeypatch.setattr(C, "time_prefills", lambda models, rows, reps: {m: 50.0 for m in models})
    monkeypatch.setattr(C, "machine_busy", lambda threshold=0.5: True)
    table, source, _ = C.cached_table(tmp_path, calls.append, ("fp32",), "cpu:test", "fp:tiny", reps=1)
    assert source == "measured" and table.busy
    assert C.cached_table(tmp_path, calls.append, ("fp32",), "cpu:test", "fp:tiny")[1] == "cache"  # still busy
    monkeypatch.setattr(C, "machine_busy", lambda threshold=0.5: False)
    table, source, notes = C.cached_table(tmp_path, calls.append, ("fp32",), "cpu:test", "fp:tiny", reps=1)
    assert source == "measured" and not table.busy and "busy" in notes[0]
    assert C.cached_table(tmp_path, calls.append, ("fp32",), "cpu:test", "fp:tiny")[1] == "cache"


# ---- load_target on a tiny bf16 checkpoint ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny bf16 Llama checkpoint with a word-level tokenizer (built offline)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tiny-bf16")
    tiny_target(seed=1, dtype=torch.bfloat16).model.save_pretrained(d)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, 128)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(d)
    return d


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTIVE_EAGLE_CACHE", str(tmp_path))
    monkeypatch.delenv("ADAPTIVE_EAGLE_DTYPE", raising=False)
    return tmp_path


def _packed(model) -> bool:
    return any(type(m).__name__ == "Fp16PackedLinear" for m in model.modules())


FORCED = {"cpu": [("bf16", "bfloat16", False), ("fp32", "float32", True)]
          + ([("fp32+fp16-weights", "float32+fp16-weights", True)] if fbgemm_fp16_available() else []),
          "cuda": [("bf16", "bfloat16", False), ("fp16", "float16", False), ("fp32", "float32", True)]}


@pytest.mark.parametrize("mode,compute,exact", FORCED["cuda" if DEVICE.startswith("cuda") else "cpu"])
def test_forced_modes(tiny_dir, cache_root, mode, compute, exact):
    t = load_target(str(tiny_dir), device=DEVICE, compute=mode)
    assert t.compute == compute and t.exact == exact and t.compute_choice.source == "compute="
    assert t.lossless == ("exact" if exact else f"lossless up to {mode} rounding")
    assert _packed(t.model) == (mode == "fp32+fp16-weights")
    assert t.dtype == C.MODE_DTYPES[mode] and t.device.type == torch.device(DEVICE).type
    assert not (cache_root / "compute").exists()  # forced: nothing measured


def test_dtype_and_environment_still_force(tiny_dir, cache_root, monkeypatch):
    t = load_target(str(tiny_dir), device=DEVICE, dtype=torch.float32)
    assert t.compute == "float32" and t.compute_choice.source == "dtype=" and not _packed(t.model)
    monkeypatch.setenv("ADAPTIVE_EAGLE_DTYPE", "bf16")
    t = load_target(str(tiny_dir), device=DEVICE)
    assert t.compute == "bfloat16" and t.compute_choice.source == "ADAPTIVE_EAGLE_DTYPE" and not t.exact
    assert load_target(str(tiny_dir), device=DEVICE, compute="fp32").compute == "float32"  # explicit beats the env
    monkeypatch.setenv("ADAPTIVE_EAGLE_DTYPE", "int8")
    with pytest.raises(ValueError, match="ADAPTIVE_EAGLE_DTYPE: compute must be one of"):
        load_target(str(tiny_dir), device=DEVICE)
    assert not (cache_root / "compute").exists()


def test_bad_compute_values_are_refused(tiny_dir, cache_root):
    with pytest.raises(ValueError, match=r"compute must be one of auto, bf16, fp32, fp32\+fp16-weights, fp16"):
        load_target(str(tiny_dir), device=DEVICE, compute="int8")
    with pytest.raises(ValueError, match="disagree"):
        load_target(str(tiny_dir), device=DEVICE, compute="bf16", dtype=torch.float32)
    with pytest.raises(ValueError, match="purpose"):
        load_target(str(tiny_dir), device=DEVICE, purpose="serve")


def test_packed_mode_needs_a_bf16_checkpoint_on_cpu(tmp_path, tiny_dir, cache_root):
    import shutil

    d = tmp_path / "tiny-fp32"
    tiny_target(seed=1, dtype=torch.float32).model.save_pretrained(d)
    for f in tiny_dir.iterdir():
        if "token" in f.name:
            shutil.copy(f, d / f.name)
    with pytest.raises(ValueError, match="bf16/fp16 checkpoint"):
        load_target(str(d), device=DEVICE, compute="fp32+fp16-weights")
    t = load_target(str(d), device=DEVICE)  # auto: fp32 is the only exact mode here, nothing is timed
    assert t.compute == "float32" and t.compute_choice.source == "only exact mode"
    assert not (cache_root / "compute").exists()


def test_training_keeps_its_dtype_policy(tiny_dir, cache_root):
    from adaptive_eagle.targets import default_dtype

    t = load_target(str(tiny_dir), device=DEVICE, purpose="train")
    assert t.dtype == default_dtype(DEVICE, "train") and t.compute_choice.source == "train"
    assert not (cache_root / "compute").exists()


def test_auto_measures_once_and_picks_an_exact_mode(tiny_dir, cache_root):
    t = load_target(str(tiny_dir), device=DEVICE)
    choice = t.compute_choice
    assert t.exact and choice.purpose == "decode"
    files = list((cache_root / "compute").glob("*.json")) if (cache_root / "compute").exists() else []
    if choice.source == "only exact mode":  # CUDA, or a CPU without FBGEMM: nothing to measure
        assert files == [] and t.compute == "float32"
    else:
        assert choice.source == "measured" and len(files) == 1 and choice.mode == C.choose_mode(choice.table)
        mtime = files[0].stat().st_mtime_ns
        again = load_target(str(tiny_dir), device=DEVICE, purpose="plain")
        assert again.compute_choice.source == "cache" and files[0].stat().st_mtime_ns == mtime
        assert again.compute_choice.mode == C.choose_mode(choice.table, "plain")
    info = describe_compute(t, measure=True)
    assert info["exact"] and info["lossless"] == "exact" and info["compute"] == t.compute
    assert set(info["table"]) == set(C.available_modes(t.device.type, "bfloat16", fbgemm_fp16_available()))
    assert info["best_exact_speculative"] in ("fp32", "fp32+fp16-weights") and info["why"]
    assert json.loads(json.dumps(info)) is not None  # printable as JSON
    assert len(list((cache_root / "compute").glob("*.json"))) == 1


def test_describe_a_hand_made_target():
    info = describe_compute(tiny_target(dtype=torch.bfloat16))
    assert info["table"] is None and info["exact"] is False and info["source"] == "set by the caller"
