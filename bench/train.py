"""TTT training throughput on CPU: the naive recipe and the efficient one, side by side, one run.

Recipes (cumulative; each row adds one change to the row above):
  naive        fp32; every TTT step attends over the materialised unrolled sequence ((j+1)·T keys
               with a mask); the target's full-vocab logits, softmax over the draft vocab; every
               position scored at every step with a plain log_softmax cross-entropy.
  +bf16        bf16 autocast. Only a win where the CPU multiplies bf16 natively (AVX512-BF16/AMX);
               elsewhere PyTorch's bf16 GEMM is ~8x slower than fp32 and train-head stays in fp32.
  +ttt-attn    prefix + diagonal attention (O(T^2) compute a step, the prefix in key blocks merged
               by log-sum-exp so memory stays linear), target rows computed only where a loss needs
               them, fused soft cross-entropy.
  +chain-rows  steps >= 1 run only for sampled chains (--rows a step): the efficient recipe that
               `adaptive-eagle train-head` uses.

Same target (SmolLM2-135M as train-head loads it), same real held-out ShareGPT English batches,
same head for all.
Prints a table and ends with one JSON line holding train_tokens_per_s and speedup_vs_naive.

`--lengths 1024,2048,4096,8192`: training on long rows instead. One row of each length (held-out
English conversations back to back), every chain row scored (no sampling), one TTT update per
measurement, the prefix attention chunked (ttt_loss's default: key blocks merged by log-sum-exp) against
dense ([T, T] scores). Each (length, attention) runs in its own process; its peak memory is the
highest resident set sampled every 2 ms during the updates, less the resident set just before them
(the target, the head and the row's features are loaded by then). A dense run past `--mem-cap-gib` of
address space fails with an allocation error, reported as such. Ends with one JSON line holding
peak_mib and tokens_per_s per length and attention, and peak_ratio_8k_over_1k for each.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adaptive_eagle.draft_head import repeat_kv  # noqa: E402
from adaptive_eagle.targets import load_target  # noqa: E402
from trainer import data as D  # noqa: E402
from trainer.offline import batches, collate, make_ttt_batch  # noqa: E402
from trainer.ttt import shift_left, step_valid_mask, ttt_loss  # noqa: E402
from trainer.warm_start import build_draft_vocab, new_head, token_counts, warm_start  # noqa: E402


class UnrolledAttention:
    """Naive TTT attention: step j's queries attend over [K_0; K_1; ...; K_j] ((j+1)·T keys) with a
    mask that keeps the causal prefix of K_0 and the diagonal of K_1..K_j."""

    def __init__(self) -> None:
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []

    def __call__(self, q, k, v):
        self.ks.append(k)
        self.vs.append(v)
        n_rep = q.shape[1] // k.shape[1]
        t = q.shape[2]
        keys = repeat_kv(torch.cat(self.ks, dim=2), n_rep)
        values = repeat_kv(torch.cat(self.vs, dim=2), n_rep)
        blocks = [torch.ones(t, t, dtype=torch.bool).tril()] + [torch.eye(t, dtype=torch.bool)] * (len(self.ks) - 1)
        visible = torch.cat(blocks, dim=1)
        mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def naive_ttt_loss(head, target, ids, mask, lengths, steps=7, decay=0.8):
    attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    with torch.no_grad():
        out = target.model(ids, attention_mask=attn, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[k] for k in target.aux_layer_ids], dim=-1).float()
        tgt_logp = torch.log_softmax(out.logits.float()[..., head.draft_to_target], dim=-1)
    b, t = ids.shape
    attend = UnrolledAttention()
    positions = torch.arange(t)[None].expand(b, t)
    hidden, total = aux, torch.zeros(())
    for j in range(steps):
        valid = step_valid_mask(mask, lengths, j)
        o = head.step(shift_left(ids, j + 1), hidden, positions + j, attend, logits_rows=True)
        hidden = o.hidden
        logp = torch.log_softmax(o.logits.float(), dim=-1)
        p = shift_left(tgt_logp, j + 1).exp()
        ce = -(p * logp).sum(-1)
        total = total + decay**j * (ce * valid).sum() / valid.sum().clamp(min=1)
    return total


def run_recipe(name, head, target, exs_batches, max_len, repeats):
    opt = torch.optim.AdamW(head.trainable_parameters(), lr=1e-5)
    times, tokens = [], 0
    for r in range(repeats + 1):
        for exs in exs_batches:
            t0 = time.perf_counter()
            if name == "naive":
                ids, mask, lengths = collate(exs, max_len)
                loss = naive_ttt_loss(head, target, ids, mask, lengths)
            else:
                batch = make_ttt_batch(target, head, exs, max_len)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name != "naive-fp32"):
                    if name == "+bf16":
                        loss = naive_ttt_loss(head, target, *collate(exs, max_len))
                    else:
                        rows = 1024 if name == "+chain-rows" else None
                        loss = ttt_loss(head, batch, max_loss_rows=rows).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            dt = time.perf_counter() - t0
            if r > 0:  # first pass warms up allocators and kernels
                n = sum(min(len(e.input_ids), max_len) for e in exs)
                times.append(dt / n)
                tokens += n
    return 1.0 / statistics.median(times), tokens


def check_agreement(head, target, exs, max_len) -> float:
    """Naive and efficient losses on one batch, fp32, every row: must agree."""
    ids, mask, lengths = collate(exs, max_len)
    with torch.no_grad():
        a = float(naive_ttt_loss(head, target, ids, mask, lengths))
        b = float(ttt_loss(head, make_ttt_batch(target, head, exs, max_len)).loss)
    return abs(a - b) / max(1e-9, abs(a))


# ---- long rows: peak memory and throughput by length, chunked vs dense attention ----------------------
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """Highest resident set seen by a 2 ms sampling thread while the block runs."""

    def __enter__(self):
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def long_row(exs, length: int):
    """One TokenizedExample of exactly `length` tokens: held-out conversations back to back."""
    ids, mask = [], []
    for e in exs:
        ids += e.input_ids
        mask += e.loss_mask
        if len(ids) >= length:
            return D.TokenizedExample(id=f"heldout-{length}", domain="english", input_ids=ids[:length], loss_mask=mask[:length])
    raise SystemExit(f"held-out English holds fewer than {length} tokens")


def one_length(length: int, attention: str, updates: int, mem_cap_gib: float) -> dict:
    """Child process: `updates` + 1 TTT updates on one row of `length` tokens (the first warms up)."""
    torch.manual_seed(0)
    target = load_target(purpose="train")
    convs = list(D.select(D.load_sharegpt(limit=4000), domains=["english"], split="heldout"))
    exs = D.tokenize_all(convs, target.tokenizer, max_len=4096)
    vocab = build_draft_vocab(token_counts(exs), 16384, target.config.vocab_size)
    head = new_head(target, vocab)
    warm_start(head, target)
    batch = make_ttt_batch(target, head, [long_row(exs, length)], length)
    opt = torch.optim.AdamW(head.trainable_parameters(), lr=1e-5)
    chunk = None if attention == "dense" else 1024
    bf16 = target.dtype == torch.bfloat16
    if attention == "dense":  # fail with an allocation error instead of taking the machine down
        cap = int(mem_cap_gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    base, times = rss_bytes(), []
    try:
        with PeakSampler() as peak:
            for u in range(updates + 1):
                t0 = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = ttt_loss(head, batch, max_loss_rows=None, attention_chunk=chunk).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                del loss
                if u > 0:
                    times.append(time.perf_counter() - t0)
    except (RuntimeError, MemoryError) as e:
        return {"length": length, "attention": attention, "failed": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}",
                "mem_cap_gib": mem_cap_gib}
    return {"length": length, "attention": attention, "peak_mib": round((peak.peak - base) / 2**20, 1),
            "tokens_per_s": round(length / statistics.median(times), 1), "updates": len(times), "bf16": bf16}


def long_rows(lengths: list[int], updates: int, mem_cap_gib: float) -> None:
    results: dict[str, dict[int, dict]] = {"chunked": {}, "dense": {}}
    print(f"{'tokens':>7s} {'attention':>9s} {'peak MiB':>9s} {'tokens/s':>9s}")
    for length in lengths:
        for attention in ("chunked", "dense"):
            cmd = [sys.executable, __file__, "--one-length", str(length), "--attention", attention,
                   "--updates", str(updates), "--mem-cap-gib", str(mem_cap_gib)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode or not lines:
                why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:160]
                r = {"length": length, "attention": attention, "failed": f"exit {proc.returncode}: {why}"}
            else:
                r = json.loads(lines[-1])
            results[attention][length] = r
            shown = (f"{r['peak_mib']:9.1f} {r['tokens_per_s']:9.1f}" if "peak_mib" in r else f"  failed: {r['failed']}")
            print(f"{length:7d} {attention:>9s} {shown}", flush=True)
    figures: dict = {"long_rows": {a: {str(k): v for k, v in r.items()} for a, r in results.items()},
                     "updates": updates}
    lo, hi = min(lengths), max(lengths)
    for a in results:
        if "peak_mib" in results[a][lo] and "peak_mib" in results[a][hi]:
            figures[f"peak_ratio_{hi}_over_{lo}_{a}"] = round(results[a][hi]["peak_mib"] / results[a][lo]["peak_mib"], 2)
        else:
            figures[f"peak_ratio_{hi}_over_{lo}_{a}"] = None
    print(json.dumps(figures))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 batches of 1024 tokens, 1 repeat (a few minutes)")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lengths", type=str, default=None, help="long rows instead: comma-separated token counts")
    ap.add_argument("--updates", type=int, default=2, help="--lengths: timed updates per length (after a warm-up)")
    ap.add_argument("--mem-cap-gib", type=float, default=16.0, help="--lengths: dense runs' address-space cap")
    ap.add_argument("--one-length", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--attention", choices=["chunked", "dense"], default="chunked", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_length is not None:
        print(json.dumps(one_length(args.one_length, args.attention, args.updates, args.mem_cap_gib)))
        return
    if args.lengths is not None:
        try:
            lengths = sorted({int(x) for x in args.lengths.split(",")})
        except ValueError:
            ap.error(f"--lengths {args.lengths!r}: comma-separated token counts, e.g. 1024,2048,4096,8192")
        if not lengths or lengths[0] < 64 or lengths[-1] > 8192 or args.updates < 1:
            ap.error("--lengths: each in [64, 8192] (the target's context); --updates >= 1")
        long_rows(lengths, 1 if args.quick else args.updates, args.mem_cap_gib)
        return
    if args.quick:
        args.batch_tokens, args.batches, args.repeats = 1024, 2, 1
    torch.manual_seed(0)
    target = load_target(purpose="train")  # as train-head loads it: bf16, or fp32 on CPUs without native bf16
    convs = list(D.select(D.load_sharegpt(limit=4000), domains=["english"], split="heldout"))
    exs = D.tokenize_all(convs, target.tokenizer, max_len=args.max_len)
    vocab = build_draft_vocab(token_counts(exs), 16384, target.config.vocab_size)
    head = new_head(target, vocab)
    warm_start(head, target)
    batch_list = [b for _, b in batches(exs, list(range(len(exs))), args.batch_tokens, args.max_len)][: args.batches]
    rel_err = check_agreement(head, target, batch_list[0], args.max_len)
    print(f"naive vs efficient loss on one fp32 batch: relative difference {rel_err:.2e}")
    rows, results = ["naive", "+bf16", "+ttt-attn", "+chain-rows"], {}
    print(f"{'recipe':14s} {'tokens/s':>9s} {'x naive':>8s}")
    for name in rows:
        tps, n = run_recipe(name, head, target, batch_list, args.max_len, args.repeats)
        results[name] = tps
        print(f"{name:14s} {tps:9.1f} {tps / results['naive']:8.2f}", flush=True)
    figures = {
        "train_tokens_per_s": round(results["+chain-rows"], 1),
        "naive_tokens_per_s": round(results["naive"], 1),
        "speedup_vs_naive": round(results["+chain-rows"] / results["naive"], 2),
        "recipes": {k: round(v, 1) for k, v in results.items()},
        "loss_agreement_rel": float(f"{rel_err:.2e}"),
        "batch_tokens": args.batch_tokens, "max_len": args.max_len, "quick": args.quick,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
