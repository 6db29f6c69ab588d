"""TTT training throughput on CPU: the naive recipe and the efficient one, side by side, one run.

Recipes (cumulative; each row adds one change to the row above):
  naive        fp32; every TTT step attends over the materialised unrolled sequence ((j+1)·T keys
               with a mask); the target's full-vocab logits, softmax over the draft vocab; every
               position scored at every step with a plain log_softmax cross-entropy.
  +bf16        bf16 autocast. Only a win where the CPU multiplies bf16 natively (AVX512-BF16/AMX);
               elsewhere PyTorch's bf16 GEMM is ~8x slower than fp32 and train-head stays in fp32.
  +ttt-attn    prefix + diagonal attention (O(T^2) a step), target rows computed only where a loss
               needs them, fused soft cross-entropy.
  +chain-rows  steps >= 1 run only for sampled chains (--rows a step): the efficient recipe that
               `adaptive-eagle train-head` uses.

Same target (SmolLM2-135M as train-head loads it), same real held-out ShareGPT English batches,
same head for all.
Prints a table and ends with one JSON line holding train_tokens_per_s and speedup_vs_naive.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 batches of 1024 tokens, 1 repeat (a few minutes)")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
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
