"""Decoding speed on CPU, batch 1, greedy: plain decoding, HF generate() (plain and with prompt
lookup) and this engine (chain, tree, tree + lookup; cost-aware, and tree + lookup with the fixed
tree size), side by side in one run, on held-out ShareGPT English prompts and on a repetitive set
(rewrite a given code block: the answer quotes its input).

The target runs the way `load_target` picks for this machine (`compute` in the JSON: bf16, or fp32
activations over fp16-packed weights on CPUs without native bf16); `plain-bf16` is plain decoding
of the same checkpoint in bf16, so the headline never hides a slower baseline: speedup_vs_plain
divides by the fastest plain row (ours, ours in bf16, or HF generate()).

Methods run interleaved prompt by prompt, so machine noise hits them alike. Reports tokens/s, mean
accept length (tokens per target forward) and speedups; ends with one JSON line holding
speedup_vs_plain, speedup_vs_prompt_lookup and accept_length_mean (the engine's tree + lookup on
English). Speculative outputs are compared token for token with plain decoding (bf16 near-ties can
flip an argmax between a one-token and a tree forward; mismatches are counted, not hidden).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adaptive_eagle.checkpoint import load_head  # noqa: E402
from adaptive_eagle.engine import EngineConfig, SpeculativeEngine  # noqa: E402
from adaptive_eagle.targets import load_target  # noqa: E402
from adaptive_eagle.trace import SamplingParams  # noqa: E402
from trainer import data as D  # noqa: E402

SHIPPED = Path(__file__).resolve().parent.parent / "heads" / "smollm2-135m-english-v2"


def english_prompts(conversations, n: int, max_chars: int = 1200) -> list[str]:
    convs = D.select(conversations, domains=["english"], split="heldout")
    out = []
    for c in convs:
        first = next((m.content for m in c.messages if m.role == "user"), "")
        if 20 <= len(first) <= max_chars:
            out.append(first)
        if len(out) == n:
            break
    return out


def code_rewrite_prompts(conversations, n: int) -> list[str]:
    convs = D.select(conversations, domains=["code"], split="heldout")
    out = []
    for c in convs:
        for m in c.messages:
            block = re.search(r"```[a-zA-Z]*\n(.{200,900}?)```", m.content, re.S) if m.role == "assistant" else None
            if block:
                out.append("Here is some code:\n```\n" + block.group(1) + "```\nRepeat this code exactly, adding a "
                           "one-line comment at the top that says what it does.")
                break
        if len(out) == n:
            break
    return out


def hf_generate(target, ids, max_new, lookup: int | None):
    x = torch.tensor([ids], device=target.device)
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                                pad_token_id=target.tokenizer.eos_token_id, **kw)
    return out[0, len(ids):].tolist()


def run_set(name, prompts, target, engines, max_new):
    rows = {m: {"tokens": 0, "seconds": 0.0, "accept": [], "mismatch": 0}
            for m in ["plain", *(["plain-bf16"] if "plain-bf16" in engines else []), "hf", "hf-lookup", *engines]}
    for i, prompt in enumerate(prompts):
        ids = engines["tree+lookup"].encode(prompt)
        sp = SamplingParams(max_tokens=max_new)
        ref = None
        for m in rows:
            t0 = time.perf_counter()
            if m.startswith("plain"):
                toks = engines[m].generate(ids, sp).token_ids
            elif m.startswith("hf"):
                toks = hf_generate(target, ids, max_new, 10 if m == "hf-lookup" else None)
            else:
                res = engines[m].generate(ids, sp)
                toks = res.token_ids
                rows[m]["accept"].append(res.accept_length_mean)
            dt = time.perf_counter() - t0
            rows[m]["tokens"] += len(toks)
            rows[m]["seconds"] += dt
            if m == "plain":
                ref = toks
            elif toks[: len(ref)] != ref[: len(toks)]:
                rows[m]["mismatch"] += 1
        print(f"  [{name}] prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    table = {}
    for m, r in rows.items():
        tps = r["tokens"] / r["seconds"] if r["seconds"] else 0.0
        table[m] = {"tokens_per_s": round(tps, 2), "accept_length_mean": round(statistics.mean(r["accept"]), 3)
                    if r["accept"] else 1.0, "mismatches": r["mismatch"]}
    # the fastest non-speculative decoding measured: ours, ours in bf16, or HF generate()
    base = max(table[m]["tokens_per_s"] for m in ("plain", "plain-bf16", "hf") if m in table) or 1e-9
    print(f"\n{name}: {len(prompts)} prompts, {max_new} new tokens each")
    print(f"{'method':18s} {'tok/s':>8s} {'x plain':>8s} {'accept':>7s} {'mismatch':>9s}")
    for m, r in table.items():
        r["speedup_vs_plain"] = round(r["tokens_per_s"] / base, 3)
        print(f"{m:18s} {r['tokens_per_s']:8.2f} {r['speedup_vs_plain']:8.2f} {r['accept_length_mean']:7.2f} "
              f"{r['mismatches']:9d}")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, default=SHIPPED)
    ap.add_argument("--quick", action="store_true", help="3 prompts per set, 48 new tokens")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--num-draft-tokens", type=int, default=16)
    ap.add_argument("--device", default="auto", help="auto: CUDA when present")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_new = 3, 48
    torch.manual_seed(0)
    target = load_target(device=args.device)
    loaded = load_head(args.head, target, device=target.device)
    head = loaded.head.to(target.dtype)
    tree = dict(depth=args.depth, topk=args.topk, num_draft_tokens=args.num_draft_tokens)
    plain_bf16 = {}
    if target.dtype != torch.bfloat16:  # the same checkpoint in bf16, as a second baseline
        bf16 = load_target(device=args.device, dtype=torch.bfloat16)
        plain_bf16 = {"plain-bf16": SpeculativeEngine(bf16, None, EngineConfig(prompt_lookup=False))}
    print(f"target compute: {target.compute}", file=sys.stderr)
    engines = {
        "plain": SpeculativeEngine(target, None, EngineConfig(prompt_lookup=False)),
        **plain_bf16,
        "chain": SpeculativeEngine(target, head, EngineConfig(depth=args.depth, topk=1, num_draft_tokens=args.depth,
                                                              prompt_lookup=False), loaded.meta.version),
        "tree": SpeculativeEngine(target, head, EngineConfig(**tree, prompt_lookup=False), loaded.meta.version),
        "tree+lookup": SpeculativeEngine(target, head, EngineConfig(**tree, prompt_lookup=True), loaded.meta.version),
        "tree+lookup-fixed": SpeculativeEngine(target, head, EngineConfig(**tree, prompt_lookup=True, cost_aware=False),
                                               loaded.meta.version),
    }
    spec = {k: v for k, v in engines.items() if k != "plain"}
    conversations = list(D.load_sharegpt())  # parsed once for both prompt sets
    with torch.inference_mode():
        eng = run_set("english", english_prompts(conversations, args.prompts), target, {**spec, "plain": engines["plain"]}, args.max_new)
        rep = run_set("repetitive", code_rewrite_prompts(conversations, args.prompts), target, {**spec, "plain": engines["plain"]},
                      args.max_new)
    best = eng["tree+lookup"]
    figures = {
        "speedup_vs_plain": best["speedup_vs_plain"],
        "speedup_vs_prompt_lookup": round(best["tokens_per_s"] / max(1e-9, eng["hf-lookup"]["tokens_per_s"]), 3),
        "accept_length_mean": best["accept_length_mean"],
        "repetitive_speedup_vs_plain": rep["tree+lookup"]["speedup_vs_plain"],
        "repetitive_speedup_vs_prompt_lookup": round(
            rep["tree+lookup"]["tokens_per_s"] / max(1e-9, rep["hf-lookup"]["tokens_per_s"]), 3),
        "english": eng, "repetitive": rep, "head": loaded.meta.version, "quick": args.quick,
        "compute": target.compute, "verify_cost_ms": {q: round(v, 1) for q, v in sorted(
            engines["tree+lookup"].verify_cost.points.items()) if q in (1, 2, 4, 8, 16, 17)},
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
