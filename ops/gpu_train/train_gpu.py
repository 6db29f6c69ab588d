"""The GPU side of the training window: receive parts, rebuild the target, train, evaluate, export.

Runs with the device's own Python (torch + transformers + safetensors there; pydantic and gguf come
as wheels in the payload, installed by ops/gpu_train.sh), with the project source on PYTHONPATH.
Two steps, each its own subcommand so the first needs the standard library only:

    receive  collect the parts this call carried (each verified by sha256, refused by name), and once
             all are held, reassemble the payload (whole-payload sha256) and unpack it. Exit 0: ready;
             exit 3: parts still missing (the next call carries them).
    train    rebuild the target (the GGUF dequantised here, then the cached safetensors rebuilt byte for
             byte and checked tensor by tensor), train a head with the train-head recipe (TTT through
             trainer.step.train_step, bf16 autocast) for --minutes of wall time, from scratch or from
             --init-head; export the head to $OUT every --checkpoint-minutes (a timeout still returns
             one) and at the end, with held-out acceptance per domain (trainer.offline.evaluate).

$OUT keeps at most 8 files of at most 16 MiB: the head comes back as $OUT/head/{config.json,
head.json, export.json, model.safetensors.NN} (export.json lists the pieces and their sha256;
ops/gpu_train.sh install joins them) plus the log. Must not touch: the network, hard-coded devices.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ops.gpu_train.parts import (
    MANIFEST,
    MiB,
    PartError,
    assemble,
    collect,
    extract_payload,
    join_file,
    read_manifest,
    sha256_file,
    split_file,
    write_text_atomic,
)

WORK = Path("/tmp/gpu_train")
OUT_PIECE_BYTES = 15 * MiB  # $OUT refuses files over 16 MiB
EXIT_WAITING = 3
EVAL_DOMAINS = ("english", "code", "math")


# ---- receive (standard library only) --------------------------------------------------------------------
def receive(sources: Sequence[Path], work: Path, log: Callable[[str], None] = print) -> Path | None:
    """Collect carried parts into work/parts; once complete, unpack the payload into work/payload
    (once per payload sha256). Returns the payload directory, or None while parts are missing."""
    manifests = [Path(s) / MANIFEST for s in sources if (Path(s) / MANIFEST).is_file()]
    store = work / "parts"
    if manifests:
        store.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(manifests[0], store / MANIFEST)
    if not (store / MANIFEST).is_file():
        raise PartError(f"no {MANIFEST} in {[str(s) for s in sources]} or {store}: carry .gpu/{MANIFEST}")
    manifest = read_manifest(store / MANIFEST)
    held, missing = collect(manifest, sources, store)
    log(f"parts held {held}, missing {missing}")
    if missing:
        calls = [k for k, names in enumerate(manifest.calls, 1) if set(names) & set(missing)]
        log(f"waiting for call(s) {calls} of {len(manifest.calls)}")
        return None
    payload_dir = work / "payload"
    marker = payload_dir / ".payload_sha256"
    if marker.is_file() and marker.read_text() == manifest.payload_sha256:
        return payload_dir
    tar = assemble(manifest, store, work / "payload.tar")
    if payload_dir.exists():
        shutil.rmtree(payload_dir)
    names = extract_payload(tar, payload_dir)
    tar.unlink()
    marker.write_text(manifest.payload_sha256)
    log(f"payload {manifest.payload_sha256[:16]}… verified and unpacked: {len(names)} files")
    return payload_dir


# ---- target ----------------------------------------------------------------------------------------
def rebuild_target(payload: Path, target_dir: Path, log: Callable[[str], None] = print) -> dict:
    """Make target_dir the same directory as this project's cached target. Returns the check:
    {identical, tensors_differing (names whose bytes differ from the packing machine's), source}."""
    src = payload / "target"
    target_dir.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.suffix != ".gguf" and p.name != "st_index.json":
            shutil.copyfile(p, target_dir / p.name)
    if not (src / "st_index.json").is_file():
        return {"identical": True, "source": "safetensors carried as is"}
    index = json.loads((src / "st_index.json").read_text())
    out = target_dir / "model.safetensors"
    if out.is_file() and out.stat().st_size == index["file_size"] and sha256_file(out) == index["file_sha256"]:
        return {"identical": True, "source": "gguf (rebuilt earlier)"}
    t0 = time.time()
    tensors = dequantise_gguf(next(src.glob("*.gguf")), target_dir)
    check = write_like(out, bytes.fromhex(index["header_hex"]), tensors, index["tensors"])
    check["identical"] = check["identical"] and sha256_file(out) == index["file_sha256"]
    log(f"target rebuilt from the GGUF in {time.time() - t0:.0f} s: "
        f"{'identical to the packing machine' if check['identical'] else check}")
    return {**check, "source": "gguf"}


def dequantise_gguf(gguf: Path, config_dir: Path) -> dict:
    """{name: bf16 tensor} of the GGUF, dequantised by transformers as targets.materialize_builtin does."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        from transformers import GgufConfig

        extra = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # older transformers dequantise GGUF files by default
        extra = {}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, **extra)
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}


def write_like(out: Path, header: bytes, tensors: dict, expected: dict) -> dict:
    """Write a safetensors file with exactly `header` (8-byte length + JSON) and each tensor's bytes at
    its offsets; compare every tensor's sha256 with `expected`."""
    import hashlib

    import torch

    spec = json.loads(header[8:])
    differing = []
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header)
        for name, s in sorted(((n, s) for n, s in spec.items() if n != "__metadata__"),
                              key=lambda kv: kv[1]["data_offsets"][0]):
            if name not in tensors:
                raise PartError(f"the dequantised target has no tensor {name!r}")
            t = tensors[name]
            if list(t.shape) != s["shape"] or s["dtype"] != "BF16":
                raise PartError(f"{name}: {list(t.shape)} {t.dtype}, the index says {s['shape']} {s['dtype']}")
            data = t.view(torch.int16).numpy().tobytes()
            a, b = s["data_offsets"]
            assert len(data) == b - a and f.tell() == len(header) + a, name
            f.write(data)
            if hashlib.sha256(data).hexdigest() != expected[name]:
                differing.append(name)
    os.replace(tmp, out)
    return {"identical": not differing, "tensors_differing": differing}


# ---- training ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimeCosine:
    """The recipe's warmup + cosine, with progress measured in wall time (the budget is minutes)."""

    lr: float
    warmup_steps: int
    min_lr_ratio: float

    def __call__(self, step: int, frac: float) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        p = min(1.0, max(0.0, frac))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def draft_vocab(data, cfg, target, log):
    """trainer.train_head.choose_vocab on the packed data: masked-token counts of the train split over
    the recipe's domains and vocab domains, the smallest size reaching vocab_coverage."""
    from collections import Counter

    import numpy as np

    from trainer.warm_start import build_draft_vocab, coverage_curve, size_for_coverage

    vocab_size = target.config.vocab_size
    idx = data.select("train", sorted(set(cfg.domains) | set(cfg.vocab_domains)))
    arr = data.masked_counts(idx, cfg.max_len, vocab_size)
    counts = Counter({int(t): int(arr[t]) for t in np.flatnonzero(arr)})
    size = cfg.draft_vocab_size or size_for_coverage(counts, cfg.vocab_coverage, cap=vocab_size)
    eos = target.tokenizer.convert_tokens_to_ids(target.tokenizer.eos_token)
    vocab = build_draft_vocab(counts, size, vocab_size, always=[eos])
    curve = coverage_curve(counts, [4096, 8192, 16384, 24576, 32768])
    log(f"draft vocab {size} covers {vocab.coverage:.3f} of the {cfg.vocab_domains} assistant tokens")
    return vocab, {"size": int(vocab.target_ids.numel()), "coverage": round(vocab.coverage, 4),
                   "domains": list(cfg.vocab_domains), "curve": {str(k): round(v, 4) for k, v in curve.items()}}


def build_head(args, cfg, target, data, log):
    """(head on the target's device in float32, parent version, vocab record, warm-start record)."""
    from adaptive_eagle import checkpoint as C
    from trainer.warm_start import new_head, warm_start

    if args.init_head:
        loaded = C.load_head(args.init_head, target, allow_fingerprint_mismatch=True)
        head, parent = loaded.head.float(), loaded.meta.version
        vocab_info, warm = {"size": head.cfg.draft_vocab_size, "from": str(args.init_head)}, None
    else:
        vocab, vocab_info = draft_vocab(data, cfg, target, log)
        head = new_head(target, vocab, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                        seed=cfg.seed).float()
        warm, parent = warm_start(head, target, layer=cfg.warm_layer, mode=cfg.warm_start), None
    head.embed_tokens.weight.requires_grad_(False)
    return head.to(target.device), parent, vocab_info, warm


def eval_sets(data, n: int, max_len: int) -> dict:
    """What `adaptive-eagle eval-head` scores: the first n held-out conversations of each domain."""
    return {d: data.examples("heldout", [d], max_len, limit=n) for d in EVAL_DOMAINS}


def evaluate_domains(head, target, sets: dict, bf16: bool, max_len: int) -> dict:
    from trainer.offline import evaluate, rounded

    out = {}
    for d, exs in sets.items():
        if exs:
            out[d] = {**rounded(evaluate(head, target, exs, max_len=max_len, bf16=bf16)), "conversations": len(exs)}
    return out


@dataclass
class Progress:
    step: int = 0
    tokens: int = 0
    epoch: int = 0
    elapsed_s: float = 0.0
    skipped: int = 0


def train(head, target, cfg, train_examples, eval_english, budget_s: float, on_checkpoint: Callable[[Progress], None],
          checkpoint_s: float, eval_s: float, log: Callable[[str], None], max_steps: int = 0) -> tuple[Progress, list]:
    """The offline recipe's updates (trainer.step.train_step on trainer.offline's length-bucketed
    batches) until `budget_s` of wall time (or `max_steps`, when > 0); `on_checkpoint` every `checkpoint_s`."""
    import torch

    from trainer.offline import batches, evaluate, exact_batches, make_ttt_batch, shuffled
    from trainer.step import adamw, set_lr, train_step

    opt = adamw(head, cfg.lr, cfg.weight_decay)
    step_cfg, lr_at = cfg.step_config(), TimeCosine(cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio)
    eval_cache = exact_batches(target, head, eval_english, cfg.max_len, cfg.batch_tokens)
    gen = torch.Generator().manual_seed(cfg.seed * 7919)
    prog, history = Progress(), []
    t0 = last_ckpt = last_eval = time.time()
    head.train()
    over = lambda: prog.elapsed_s >= budget_s or 0 < max_steps <= prog.step
    while not over():
        for _, exs in batches(train_examples, shuffled(len(train_examples), cfg.seed, prog.epoch), cfg.batch_tokens,
                              cfg.max_len):
            set_lr(opt, lr_at(prog.step, prog.elapsed_s / budget_s))
            stats = train_step(head, make_ttt_batch(target, head, exs, cfg.max_len), opt, None, step_cfg,
                               step=prog.step, generator=gen)
            prog.step, prog.tokens, prog.skipped = prog.step + 1, prog.tokens + stats.tokens, prog.skipped + stats.skipped
            prog.elapsed_s = time.time() - t0
            if time.time() - last_eval >= eval_s or over():
                s = evaluate(head, target, eval_english, steps=cfg.ttt_steps, bf16=cfg.bf16, cached=eval_cache)
                history.append({"step": prog.step, "tokens": prog.tokens, "elapsed_s": round(prog.elapsed_s, 1),
                                "alpha": [round(a, 4) for a in s["alpha"]],
                                "accept_length": round(s["accept_length"], 4), "loss": round(s["loss"], 4)})
                log(f"[eval] step {prog.step} tokens {prog.tokens} ({prog.tokens / prog.elapsed_s:.0f} tok/s) "
                    f"loss {stats.loss:.3f} lr {stats.lr:.1e} accept_len {s['accept_length']:.3f}")
                last_eval = time.time()
            if time.time() - last_ckpt >= checkpoint_s:
                on_checkpoint(prog)
                last_ckpt = time.time()
            if over():
                break
        else:
            prog.epoch += 1
    return prog, history


# ---- export ----------------------------------------------------------------------------------------------
def export_head(head_dir: Path, out: Path, summary: dict) -> Path:
    """Copy a head version directory into out/head as pieces $OUT can return; replaces an older export."""
    new, final, old = out / "head.new", out / "head", out / "head.old"
    for d in (new, old):
        shutil.rmtree(d, ignore_errors=True)
    new.mkdir(parents=True)
    for name in ("config.json", "head.json"):
        shutil.copyfile(head_dir / name, new / name)
    pieces = split_file(head_dir / "model.safetensors", new, OUT_PIECE_BYTES, "model.safetensors")
    write_text_atomic(new / "export.json", json.dumps({"version": head_dir.name, "pieces": pieces,
                                                       "summary": summary}, indent=1) + "\n")
    if final.exists():
        final.rename(old)
    new.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def import_head(export_dir: Path, dest_root: Path) -> Path:
    """The reverse of export_head (run here, on the returned files): join and verify the weights,
    write <dest_root>/<version>/ and check it loads (sha256 in head.json)."""
    meta = json.loads((export_dir / "export.json").read_text())
    dest = dest_root / meta["version"]
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "head.json"):
        shutil.copyfile(export_dir / name, dest / name)
    join_file(meta["pieces"], export_dir, dest / "model.safetensors")
    want = json.loads((dest / "head.json").read_text())["sha256"]
    if sha256_file(dest / "model.safetensors") != want:
        raise PartError(f"{dest}/model.safetensors: sha256 does not match its head.json")
    return dest


def gpu_record(target, args, prog: Progress | None, payload: Path, target_check: dict, partial: bool) -> dict:
    import torch
    import transformers

    dev = target.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{dev.type} (no GPU)"
    rec = {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
           "minutes_budget": args.minutes, "partial": partial, "target_check": target_check,
           "payload_sha256": (payload / ".payload_sha256").read_text() if (payload / ".payload_sha256").is_file()
           else None}
    if prog is not None:
        rec.update(steps=prog.step, tokens=prog.tokens, epochs=prog.epoch, seconds=round(prog.elapsed_s, 1),
                   tokens_per_s=round(prog.tokens / max(prog.elapsed_s, 1e-9)), skipped_steps=prog.skipped)
    return rec


# ---- the two steps -----------------------------------------------------------------------------------
def recipe(args, target_name: str, bf16: bool):
    from trainer.offline import TrainHeadConfig

    lr = args.lr if args.lr is not None else (1e-4 if args.init_head else 5e-4)
    return TrainHeadConfig(target=target_name, domains=list(args.domains), max_len=args.max_len,
                           batch_tokens=args.batch_tokens, token_budget=10**12, time_budget_min=args.minutes, lr=lr,
                           warmup_steps=args.warmup_steps, max_loss_rows=args.max_loss_rows or None, bf16=bf16,
                           seed=args.seed, eval_convs=args.eval_convs, checkpoint_minutes=args.checkpoint_minutes,
                           draft_vocab_size=args.draft_vocab_size)


def run_train(args, log: Callable[[str], None] = print) -> dict:
    """rebuild target → load (bf16 on CUDA) → data → head → train → evaluate → export. Returns the summary."""
    import torch

    from adaptive_eagle import checkpoint as C
    from adaptive_eagle.targets import load_target, resolve_device
    from ops.gpu_train.tokens import read_tokens
    from trainer.offline import evaluate, rounded

    payload, work = Path(args.payload), Path(args.work)
    out = Path(args.out or os.environ.get("OUT") or work / "out")
    info = json.loads((payload / "payload.json").read_text())
    target_check = rebuild_target(payload, work / "target", log)
    device = resolve_device(args.device)
    bf16 = device.type == "cuda" if args.bf16 is None else args.bf16
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        log(f"device {torch.cuda.get_device_name(device)}")
    target = load_target(str(work / "target"), device=device, dtype=torch.bfloat16 if bf16 else torch.float32,
                         purpose="train")
    fingerprint = info["fingerprint"] if target_check["identical"] else target.fingerprint
    cfg = recipe(args, info["target_name"], bf16)
    data = read_tokens(payload / "data" / "tokens.npz")
    train_examples = data.examples("train", cfg.domains, cfg.max_len)
    eval_english = data.examples("heldout", ["english"], cfg.max_len, limit=cfg.eval_convs)
    eval_len = min(args.eval_max_len, int(data.meta.get("max_len") or args.eval_max_len))
    sets = eval_sets(data, args.eval_n, eval_len)
    log(f"{len(train_examples)} train conversations ({sum(len(e.input_ids) for e in train_examples)} tokens) "
        f"of {cfg.domains}; held-out {({d: len(v) for d, v in sets.items()})}")
    head, parent, vocab_info, warm = build_head(args, cfg, target, data, log)
    baseline = evaluate_domains(head, target, sets, bf16, eval_len) if args.init_head else None
    version = args.version or f"{info['target_name']}-gpu-{time.strftime('%Y%m%d-%H%M', time.gmtime())}"

    def save(prog: Progress, metrics: dict, partial: bool) -> Path:
        meta = C.HeadMeta.new(
            version=version, target_name=info["target_name"], target_fingerprint=fingerprint, parent=parent,
            data={"source": info.get("data_source", "packed"), "domains": cfg.domains, "split": "train",
                  "tokens_seen": prog.tokens, "vocab": vocab_info, "payload": info.get("max_len")},
            training={**cfg.model_dump(), "warm_start": warm,
                      "gpu_run": gpu_record(target, args, prog, payload, target_check, partial)},
            metrics=metrics)
        C.save_head(head, work / "heads" / version, meta, overwrite=True)
        summary = {"partial": partial, "tokens": prog.tokens, "steps": prog.step, "metrics": metrics}
        return export_head(work / "heads" / version, out, summary)

    def checkpoint(prog: Progress) -> None:
        d = save(prog, {"train_tokens": prog.tokens, "train_steps": prog.step, "heldout_eval_init": baseline}, True)
        log(f"checkpoint: {d} at {prog.tokens} tokens")

    prog, history = train(head, target, cfg, train_examples, eval_english, args.minutes * 60, checkpoint,
                          args.checkpoint_minutes * 60, args.eval_minutes * 60, log, args.max_steps)
    final = evaluate_domains(head, target, sets, bf16, eval_len)
    english = rounded(evaluate(head, target, eval_english, max_len=cfg.max_len, steps=cfg.ttt_steps, bf16=bf16))
    metrics = {"heldout_eval": final, "heldout_eval_init": baseline, "heldout_english": english,
               "train_tokens": prog.tokens, "train_steps": prog.step, "train_seconds": round(prog.elapsed_s, 1),
               "history": history[-50:]}
    d = save(prog, metrics, False)
    for dom, r in final.items():
        was = f" (init {baseline[dom]['accept_length']:.3f})" if baseline and dom in baseline else ""
        log(f"{dom:8s} accept_length {r['accept_length']:.3f}{was} alpha {' '.join(f'{a:.3f}' for a in r['alpha'])}")
    log(f"head exported to {d}")
    return {"head": str(d), "version": version, "metrics": metrics}


def parse_args(argv: Sequence[str] | None):
    ap = argparse.ArgumentParser(description="GPU side of ops/gpu_train.sh (see the module docstring)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("receive")
    r.add_argument("--sources", type=Path, nargs="+", default=[Path(".gpu")])
    r.add_argument("--work", type=Path, default=WORK)
    t = sub.add_parser("train")
    t.add_argument("--work", type=Path, default=WORK)
    t.add_argument("--payload", type=Path, default=None, help="default: <work>/payload")
    t.add_argument("--out", type=Path, default=None, help="default: $OUT, else <work>/out")
    t.add_argument("--minutes", type=float, default=6.0, help="wall-time training budget")
    t.add_argument("--max-steps", type=int, default=0, help="stop after this many steps too (0: the minutes alone)")
    t.add_argument("--checkpoint-minutes", type=float, default=2.0)
    t.add_argument("--eval-minutes", type=float, default=1.0)
    t.add_argument("--init-head", type=Path, default=None, help="fine-tune this head (default: from scratch)")
    t.add_argument("--device", default="auto")
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None, help="default: on CUDA")
    t.add_argument("--domains", nargs="+", default=list(EVAL_DOMAINS))
    t.add_argument("--max-len", type=int, default=2048)
    t.add_argument("--batch-tokens", type=int, default=32768)
    t.add_argument("--max-loss-rows", type=int, default=16384, help="0: all")
    t.add_argument("--lr", type=float, default=None, help="default 5e-4 from scratch, 1e-4 from --init-head")
    t.add_argument("--warmup-steps", type=int, default=50)
    t.add_argument("--draft-vocab-size", type=int, default=None)
    t.add_argument("--eval-n", type=int, default=48, help="held-out conversations per domain (eval-head's default)")
    t.add_argument("--eval-max-len", type=int, default=1024, help="eval-head's default (capped by the pack's)")
    t.add_argument("--eval-convs", type=int, default=24, help="held-out English conversations watched in training")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--version", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "train" and args.payload is None:
        args.payload = args.work / "payload"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.cmd == "receive":
            return 0 if receive(args.sources, args.work) is not None else EXIT_WAITING
        run_train(args)
        return 0
    except PartError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
