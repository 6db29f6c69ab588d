"""Regenerated training data: ShareGPT prompts answered by the target itself (`adaptive-eagle regen-data`).

Owns: answering the first user turn of ShareGPT conversations with the target's own greedy decoding, in
batches, and writing the pairs as JSONL in the format `train-head --data-jsonl` reads ({id, conversations:
[{role, content}]}). Must not touch: the training loop (offline.py), heads.

Why: a draft head is scored on the target's own continuations, and at decode time its context is the
target's own text. ShareGPT's answers were written by other models; a small target continues them
differently (more repetitive, more predictable), so a head trained only on them learns the target's
next token on text the target would not have written. SpecForge recommends regenerating the answers with
the target for the same reason (the EAGLE-1 paper found EAGLE not very sensitive to it; at this project's CPU
budget it lifted offline acceptance and not decoding: docs/results/regen-2026-12-07-epyc).

Splits: every record keeps its ShareGPT id, so `trainer.data.split_of` puts it in the same train/held-out
split as its source conversation: held-out prompts answered here only ever serve evaluation.

Resumable: ids already in the output file are skipped; each batch is appended and flushed, so a stopped
run loses at most one batch. A run killed in the middle of a write leaves a torn last line: the next run cuts it
off (and says so) before it appends; a bad line anywhere else is refused with its line number.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from trainer import data as D

# where a cut reply may end: a line end, or a sentence end that is not a list number ("2. ")
BOUNDARY = re.compile(r"\n|(?<![0-9])[.!?](?=\s|$)")


@dataclass(frozen=True)
class RegenConfig:
    out: Path
    domains: tuple[str, ...] = ("english",)
    train_conversations: int = 2000  # prompts from the train split
    heldout_conversations: int = 48  # and from the held-out split (evaluation only)
    max_new_tokens: int = 256
    max_prompt_tokens: int = 384
    batch: int = 32
    compute: str = "bf16"  # load_target's compute: bf16 batches fastest on CPUs with native bf16


def validate(cfg: RegenConfig) -> None:
    """Raise ValueError naming the field and its allowed range."""
    checks = [("train_conversations", cfg.train_conversations, 0, 10**7),
              ("heldout_conversations", cfg.heldout_conversations, 0, 10**6),
              ("max_new_tokens", cfg.max_new_tokens, 8, 4096), ("max_prompt_tokens", cfg.max_prompt_tokens, 8, 8192),
              ("batch", cfg.batch, 1, 512)]
    for name, value, lo, hi in checks:
        if not lo <= value <= hi:
            raise ValueError(f"{name}: {value} is outside {lo}..{hi}")
    bad = set(cfg.domains) - set(D.DOMAINS)
    if bad or not cfg.domains:
        raise ValueError(f"domains: unknown {sorted(bad)}; choose from {D.DOMAINS}")


def drop_torn_tail(path: Path, chunk: int = 1 << 16) -> int:
    """Cut a torn last line (no trailing newline: the writer was killed mid-line) off `path`; bytes cut. Reads
    back from the end only as far as the last newline."""
    if not path.exists() or path.stat().st_size == 0:
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, 2)
        end = size
        while end > 0:
            start = max(0, end - chunk)
            f.seek(start)
            block = f.read(end - start)
            if end == size and block.endswith(b"\n"):
                return 0
            nl = block.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            end = start
        else:
            keep = 0
        f.truncate(keep)
    return size - keep


def done_ids(path: Path) -> set[str]:
    """Ids already answered in `path` (empty when it does not exist)."""
    if not path.exists():
        return set()
    return {str(obj["id"]) for _, obj in D.jsonl_objects(path) if isinstance(obj, dict) and "id" in obj}


def pick_prompts(conversations: Iterable[D.Conversation], cfg: RegenConfig, skip: set[str],
                 ) -> list[tuple[str, str]]:
    """(id, first user message) for the first cfg.train_conversations train and cfg.heldout_conversations
    held-out conversations of cfg.domains, minus `skip`. A first message under D.MIN_PROMPT_CHARS or one seen
    before is passed over."""
    want = {"train": cfg.train_conversations, "heldout": cfg.heldout_conversations}
    got = {"train": 0, "heldout": 0}
    seen: set[str] = set()
    out = []
    for c in D.select(conversations, domains=cfg.domains, split=None):
        split = D.split_of(c.id)
        if got[split] >= want[split]:
            if all(got[s] >= want[s] for s in want):
                break
            continue
        first = next((m.content for m in c.messages if m.role == "user"), "").strip()
        if len(first) < D.MIN_PROMPT_CHARS or first in seen:
            continue
        seen.add(first)
        got[split] += 1
        if c.id not in skip:
            out.append((c.id, first))
    return out


def trim_unfinished(text: str) -> str:
    """A reply cut by the token limit, trimmed to its last sentence or line end (the chat template closes
    every assistant turn with end-of-turn, which the head would otherwise learn after half a word)."""
    cut = max((m.end() for m in BOUNDARY.finditer(text)), default=0)
    return text[:cut].rstrip() if cut > len(text) // 3 else text.rstrip()


@torch.inference_mode()
def answer_batch(model, tokenizer, prompts: list[str], cfg: RegenConfig) -> list[str]:
    """The target's greedy replies to `prompts` (left-padded into one batch)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(**enc.to(model.device), max_new_tokens=cfg.max_new_tokens, do_sample=False,
                         pad_token_id=pad)
    replies = []
    for row in out[:, enc.input_ids.shape[1]:]:
        toks = row.tolist()
        finished = tokenizer.eos_token_id in toks
        if finished:
            toks = toks[:toks.index(tokenizer.eos_token_id)]
        text = tokenizer.decode(toks, skip_special_tokens=True)
        replies.append(text.strip() if finished else trim_unfinished(text))
    return replies


def regenerate(cfg: RegenConfig, target, conversations: Iterable[D.Conversation],
               progress: Callable[[int, int, float], None] | None = None) -> dict:
    """Answer the picked prompts with `target` and append them to cfg.out. Returns counts."""
    validate(cfg)
    tok = target.tokenizer
    tok.padding_side = "left"
    torn = drop_torn_tail(cfg.out)
    skip = done_ids(cfg.out)
    todo, long = [], 0
    for cid, prompt in pick_prompts(conversations, cfg, skip):
        ids = tok.encode(prompt, add_special_tokens=False)
        if len(ids) > cfg.max_prompt_tokens:
            long += 1  # a long prompt would pad the whole batch to its length
            continue
        todo.append((len(ids), cid, prompt))
    todo.sort()  # similar lengths batch together: less padding
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    written = empty = tokens = 0
    t0 = time.monotonic()
    with open(cfg.out, "a", encoding="utf-8") as f:
        for i in range(0, len(todo), cfg.batch):
            chunk = todo[i:i + cfg.batch]
            replies = answer_batch(target.model, tok, [p for _, _, p in chunk], cfg)
            for (_, cid, prompt), reply in zip(chunk, replies):
                if not reply:
                    empty += 1
                    continue
                tokens += len(tok.encode(reply, add_special_tokens=False))
                f.write(json.dumps({"id": cid, "conversations": [{"role": "user", "content": prompt},
                                                                 {"role": "assistant", "content": reply}]}) + "\n")
                written += 1
            f.flush()
            if progress:
                progress(min(i + cfg.batch, len(todo)), len(todo), tokens / max(time.monotonic() - t0, 1e-9))
    return {"written": written, "skipped_done": len(skip), "skipped_long": long, "torn_bytes_dropped": torn,
            "empty_replies": empty, "reply_tokens": tokens,
            "seconds": round(time.monotonic() - t0, 1), "out": str(cfg.out)}
