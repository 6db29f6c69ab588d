"""trainer.train_head: `train-head` end to end on CPU on a tiny local target (a word-level tokenizer, a JSONL of
conversations): the head it saves loads and records its recipe, vocabulary and metrics, and a second call resumes
the run. The named steps the GPU window (ops/gpu_train/train_gpu.py) also calls on their own: bf16 for a device,
the draft vocabulary, the head a run starts from, held-out acceptance per domain."""

import json

import pytest
import torch

from adaptive_eagle.checkpoint import HeadMeta, load_head, save_head
from adaptive_eagle.targets import load_target
from tests.ops.test_gpu_train import conversations, tiny_target_dir, word_tokenizer
from trainer.data import tokenize_all
from trainer.offline import TrainHeadConfig, evaluate, rounded
from trainer.train_head import (EVAL_DOMAINS, HeadStart, domain_result, draft_vocab, evaluate_domains, fresh_head,
                                head_from, resolve_bf16, run_train_head, vocab_counts)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target directory and a JSONL of its conversations (word tokens the tokenizer knows)."""
    root = tmp_path_factory.mktemp("train-head")
    target_dir = tiny_target_dir(root / "tiny", word_tokenizer())
    data = root / "convs.jsonl"
    data.write_text("".join(json.dumps({"id": c.id, "conversations": [{"role": m.role, "content": m.content}
                                                                      for m in c.messages]}) + "\n"
                            for c in conversations(160)))
    return target_dir, data


def recipe(world, **kw) -> TrainHeadConfig:
    target_dir, data = world
    base = dict(target=str(target_dir), data_jsonl=str(data), max_len=96, batch_tokens=512, token_budget=1500,
                bf16=False, warmup_steps=2, ttt_steps=3, max_loss_rows=None, eval_convs=4, eval_every=1000,
                checkpoint_minutes=100, lr=3e-3)
    base.update(kw)
    return TrainHeadConfig(**base)


def test_train_head_saves_a_loadable_head_and_resumes_its_run(world, tmp_path, one_thread):
    cfg = recipe(world)
    logs: list[str] = []
    first = run_train_head(cfg, tmp_path / "run", tmp_path / "head", version="tiny-v1", progress=False,
                           log=logs.append, device="cpu")
    assert first["state"]["tokens"] >= cfg.token_budget and first["head"] == str(tmp_path / "head")
    target = load_target(cfg.target, dtype=torch.float32, purpose="train")
    loaded = load_head(tmp_path / "head", target)
    meta = json.loads((tmp_path / "head" / "head.json").read_text())
    assert loaded.meta.version == "tiny-v1" and meta["parent"] is None
    assert meta["training"] == {**cfg.model_dump(), "warm_start": meta["training"]["warm_start"]}
    assert meta["training"]["warm_start"]["mode"] == "full"
    assert set(meta["data"]["vocab"]) == {"size", "coverage", "domains", "curve"}
    assert meta["metrics"]["train_steps"] == first["state"]["step"]
    assert meta["metrics"]["heldout_english"] == rounded(first["heldout_english"])
    assert any(line.startswith("draft vocab ") for line in logs)

    more = cfg.model_copy(update={"token_budget": first["state"]["tokens"] + 300})
    logs.clear()
    second = run_train_head(more, tmp_path / "run", None, progress=False, log=logs.append)
    assert any(line.startswith("resumed ") for line in logs)
    assert second["state"]["step"] > first["state"]["step"] and "head" not in second


def test_a_fresh_head_and_a_fine_tuned_one_say_where_they_came_from(world, tmp_path):
    cfg = recipe(world, warm_start="output")
    target = load_target(cfg.target, dtype=torch.float32, purpose="train")
    train = tokenize_all(conversations(60), target.tokenizer, max_len=cfg.max_len)
    counts = vocab_counts(cfg, target, train)
    vocab, record = draft_vocab(cfg, target, counts, log=lambda s: None)
    eos = target.tokenizer.convert_tokens_to_ids(target.tokenizer.eos_token)
    assert eos in vocab.target_ids.tolist() and record["size"] == vocab.target_ids.numel()

    fresh = fresh_head(cfg, target, counts, log=lambda s: None)
    assert isinstance(fresh, HeadStart) and fresh.parent is None and fresh.vocab == record
    assert fresh.warm_start == {"mode": "output", "copied": ["lm_head", "norm"]}
    assert list(fresh.extra()) == ["vocab", "warm_start", "parent"]
    assert fresh.head.embed_tokens.weight.device == target.device and not fresh.head.embed_tokens.weight.requires_grad
    assert "warm_start" not in fresh_head(recipe(world, warm_start="none"), target, counts, lambda s: None).extra()

    save_head(fresh.head, tmp_path / "v1", HeadMeta.new(version="v1", target_name="tiny",
                                                        target_fingerprint=target.fingerprint))
    tuned = head_from(tmp_path / "v1", target)
    assert (tuned.parent, tuned.warm_start) == ("v1", None)
    assert tuned.vocab == {"size": fresh.head.cfg.draft_vocab_size, "from": str(tmp_path / "v1")}
    assert tuned.extra() == {"vocab": tuned.vocab, "parent": "v1"}
    assert tuned.head.embed_tokens.weight.dtype == torch.float32 and not tuned.head.embed_tokens.weight.requires_grad

    sets = {"english": train[:3], "code": [], "math": train[3:5]}
    scored = evaluate_domains(fresh.head, target, sets, max_len=cfg.max_len, bf16=False)
    assert list(scored) == ["english", "math"]  # a domain without examples is left out
    assert scored["math"] == {**rounded(evaluate(fresh.head, target, train[3:5], max_len=cfg.max_len, bf16=False)),
                              "conversations": 2}
    assert scored["english"] == domain_result(fresh.head, target, train[:3], max_len=cfg.max_len, bf16=False)
    assert EVAL_DOMAINS == ("english", "code", "math")


def test_bf16_is_resolved_for_the_device_once(world, monkeypatch):
    assert resolve_bf16(recipe(world, bf16=True), "cpu").bf16 is True
    assert resolve_bf16(recipe(world, bf16=False), "cpu").bf16 is False
    monkeypatch.setenv("ADAPTIVE_EAGLE_DTYPE", "fp32")  # targets.default_dtype's override
    assert resolve_bf16(recipe(world, bf16=None), "cpu").bf16 is False
    monkeypatch.setenv("ADAPTIVE_EAGLE_DTYPE", "bf16")
    assert resolve_bf16(recipe(world, bf16=None), "cpu").bf16 is True
