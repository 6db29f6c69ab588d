"""The GPU side of the training window: receive parts, rebuild the target, train, evaluate, export.

Runs with the device's own Python (torch + transformers + safetensors there; pydantic and gguf come
as wheels in the payload, installed by ops/gpu_train.sh), with the project source on PYTHONPATH.
Two steps, each its own subcommand so the first needs the standard library only:

    receive  collect the parts this call carried (each verified by sha256, refused by name), and once
             all are held, reassemble the payload (whole-payload sha256) and unpack it. Exit 0: ready;
             exit 3: parts still missing (the next call carries them).
    train    rebuild the target (the GGUF dequantised here, then the cached safetensors rebuilt byte for
             byte and checked tensor by tensor) and load it on --device, then train with trainer/ itself:
             the head from trainer.train_head (fresh_head on the packed data's counts, or head_from
             --init-head), the loop trainer.offline.train_loop (bf16 resolved for the device, a budget of
             --minutes of wall time over which the lr decays, held-out English every --eval-minutes, the run
             state checkpointed every --checkpoint-minutes), held-out acceptance per domain by
             trainer.train_head.evaluate_domains; export the head to $OUT at every checkpoint (a timeout
             still returns one) and at the end.

Owns only what is specific to the window: receiving the packed payload, rebuilding the target from the
GGUF, the window's arguments as a train-head recipe, exporting and importing the head through $OUT, and
the record of the run (head.json training.gpu_run). $OUT keeps at most 8 files of at most 16 MiB: the
head comes back as $OUT/head/{config.json, head.json, export.json, model.safetensors.NN} (export.json
lists the pieces and their sha256; ops/gpu_train.sh install joins them) plus the log. Must not touch:
the network, hard-coded devices, the training recipe's logic (trainer/ holds it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # the receive step runs before torch, pydantic or the project's packages are importable
    from adaptive_eagle.targets import Target
    from ops.gpu_train.tokens import TokenData
    from trainer.offline import RunState, TrainHeadConfig
    from trainer.train_head import HeadStart

WORK = Path("/tmp/gpu_train")
OUT_PIECE_BYTES = 15 * MiB  # $OUT refuses files over 16 MiB
EXIT_WAITING = 3


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


# ---- training: trainer/ on the window's device ------------------------------------------------------------
def packed_counts(data: TokenData, cfg: TrainHeadConfig, vocab_size: int) -> Counter:
    """trainer.train_head.vocab_counts on the packed data: masked-token counts of the train split over the
    recipe's domains and vocab domains."""
    import numpy as np

    arr = data.masked_counts(data.select("train", sorted(set(cfg.domains) | set(cfg.vocab_domains))), cfg.max_len,
                             vocab_size)
    return Counter({int(t): int(arr[t]) for t in np.flatnonzero(arr)})


def eval_sets(data: TokenData, n: int, max_len: int) -> dict:
    """What `adaptive-eagle eval-head` scores, from the packed data: the first n held-out conversations of each
    domain."""
    from trainer.train_head import EVAL_DOMAINS

    return {d: data.examples("heldout", [d], max_len, limit=n) for d in EVAL_DOMAINS}


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


def gpu_record(target: Target, args, state: RunState | None, payload: Path, target_check: dict,
               partial: bool) -> dict:
    """The record of the run (head.json training.gpu_run): device, versions, budget, target check, progress."""
    import torch
    import transformers

    dev = target.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{dev.type} (no GPU)"
    rec = {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
           "minutes_budget": args.minutes, "partial": partial, "target_check": target_check,
           "payload_sha256": (payload / ".payload_sha256").read_text() if (payload / ".payload_sha256").is_file()
           else None}
    if state is not None:
        rec.update(steps=state.step, tokens=state.tokens, epochs=state.epoch, seconds=round(state.elapsed_s, 1),
                   tokens_per_s=round(state.tokens / max(state.elapsed_s, 1e-9)), skipped_steps=state.skipped)
    return rec


# ---- the two steps -----------------------------------------------------------------------------------
def recipe(args, target_name: str, bf16: bool | None) -> TrainHeadConfig:
    """The train-head recipe of this window's arguments (bf16 None: resolved for the device by the caller)."""
    from trainer.offline import TrainHeadConfig
    from trainer.train_head import EVAL_DOMAINS

    lr = args.lr if args.lr is not None else (1e-4 if args.init_head else 5e-4)
    return TrainHeadConfig(target=target_name, domains=list(args.domains or EVAL_DOMAINS), max_len=args.max_len,
                           batch_tokens=args.batch_tokens, token_budget=10**12, time_budget_min=args.minutes, lr=lr,
                           warmup_steps=args.warmup_steps, max_loss_rows=args.max_loss_rows or None, bf16=bf16,
                           seed=args.seed, eval_convs=args.eval_convs, checkpoint_minutes=args.checkpoint_minutes,
                           draft_vocab_size=args.draft_vocab_size)


@dataclass(frozen=True)
class Window:
    """What the training call works with: the unpacked payload, the rebuilt target on the device, the recipe."""

    payload: Path
    work: Path
    out: Path
    info: dict  # payload.json
    target_check: dict  # rebuild_target's check
    target: Target  # on the device, bf16 when the recipe is
    fingerprint: str  # the packing machine's when the target was rebuilt identical
    cfg: TrainHeadConfig  # bf16 resolved for the device
    data: TokenData  # the packed conversations


def open_window(args, log: Callable[[str], None]) -> Window:
    """Rebuild the target from the payload, resolve the recipe for the device and load the target there."""
    import torch

    from adaptive_eagle.targets import load_target, resolve_device
    from ops.gpu_train.tokens import read_tokens
    from trainer.train_head import resolve_bf16

    payload, work = Path(args.payload), Path(args.work)
    out = Path(args.out or os.environ.get("OUT") or work / "out")
    info = json.loads((payload / "payload.json").read_text())
    target_check = rebuild_target(payload, work / "target", log)
    device = resolve_device(args.device)
    cfg = resolve_bf16(recipe(args, info["target_name"], args.bf16), device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        log(f"device {torch.cuda.get_device_name(device)}")
    target = load_target(str(work / "target"), device=device, dtype=torch.bfloat16 if cfg.bf16 else torch.float32,
                         purpose="train")
    fingerprint = info["fingerprint"] if target_check["identical"] else target.fingerprint
    return Window(payload, work, out, info, target_check, target, fingerprint, cfg,
                  read_tokens(payload / "data" / "tokens.npz"))


def run_train(args, log: Callable[[str], None] = print) -> dict:
    """rebuild target → load on the device → data → head → trainer.offline.train_loop → evaluate → export."""
    from trainer.budget import Budget, Cadence
    from trainer.offline import rounded, train_loop
    from trainer.train_head import evaluate_domains, fresh_head, head_from

    w = open_window(args, log)
    cfg, target, data = w.cfg, w.target, w.data
    train_examples = data.examples("train", cfg.domains, cfg.max_len)
    eval_english = data.examples("heldout", ["english"], cfg.max_len, limit=cfg.eval_convs)
    eval_len = min(args.eval_max_len, int(data.meta.get("max_len") or args.eval_max_len))
    sets = eval_sets(data, args.eval_n, eval_len)
    log(f"{len(train_examples)} train conversations ({sum(len(e.input_ids) for e in train_examples)} tokens) "
        f"of {cfg.domains}; held-out {({d: len(v) for d, v in sets.items()})}")
    start = (head_from(args.init_head, target, allow_fingerprint_mismatch=True) if args.init_head
             else fresh_head(cfg, target, packed_counts(data, cfg, target.config.vocab_size), log))
    baseline = evaluate_domains(start.head, target, sets, max_len=eval_len, bf16=cfg.bf16) if args.init_head else None
    version = args.version or f"{w.info['target_name']}-gpu-{time.strftime('%Y%m%d-%H%M', time.gmtime())}"

    def checkpoint(state) -> None:
        metrics = {"train_tokens": state.tokens, "train_steps": state.step, "heldout_eval_init": baseline}
        log(f"checkpoint: {save_and_export(w, args, start, version, state, metrics, True)} at {state.tokens} tokens")

    state, last = train_loop(cfg, w.work / "run", target, start.head, train_examples, eval_english,
                             extra=start.extra(), progress=False, log=log, on_checkpoint=checkpoint,
                             budget=Budget.of(cfg, steps=args.max_steps or None, decay_over="seconds"),
                             cadence=Cadence(eval_seconds=args.eval_minutes * 60,
                                             checkpoint_seconds=args.checkpoint_minutes * 60))
    final = evaluate_domains(start.head, target, sets, max_len=eval_len, bf16=cfg.bf16)
    metrics = {"heldout_eval": final, "heldout_eval_init": baseline, "heldout_english": rounded(last),
               "train_tokens": state.tokens, "train_steps": state.step, "train_seconds": round(state.elapsed_s, 1),
               "history": state.history[-50:]}
    d = save_and_export(w, args, start, version, state, metrics, False)
    for dom, r in final.items():
        was = f" (init {baseline[dom]['accept_length']:.3f})" if baseline and dom in baseline else ""
        log(f"{dom:8s} accept_length {r['accept_length']:.3f}{was} alpha {' '.join(f'{a:.3f}' for a in r['alpha'])}")
    log(f"head exported to {d}")
    return {"head": str(d), "version": version, "metrics": metrics}


def save_and_export(w: Window, args, start: HeadStart, version: str, state: RunState, metrics: dict,
                    partial: bool) -> Path:
    """Save the head being trained as heads/<version> in the work directory (head.json with the recipe, the
    vocabulary, the metrics and the record of the run) and export it to $OUT."""
    from adaptive_eagle import checkpoint as C

    cfg = w.cfg
    meta = C.HeadMeta.new(
        version=version, target_name=w.info["target_name"], target_fingerprint=w.fingerprint, parent=start.parent,
        data={"source": w.info.get("data_source", "packed"), "domains": cfg.domains, "split": "train",
              "tokens_seen": state.tokens, "vocab": start.vocab, "payload": w.info.get("max_len")},
        training={**cfg.model_dump(), "warm_start": start.warm_start,
                  "gpu_run": gpu_record(w.target, args, state, w.payload, w.target_check, partial)},
        metrics=metrics)
    C.save_head(start.head, w.work / "heads" / version, meta, overwrite=True)
    summary = {"partial": partial, "tokens": state.tokens, "steps": state.step, "metrics": metrics}
    return export_head(w.work / "heads" / version, w.out, summary)


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
    t.add_argument("--domains", nargs="+", default=None, help="default: eval-head's (english code math)")
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
