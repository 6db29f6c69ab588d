"""Greedy exactness on held-out prompts: the speculative engine's output against plain greedy decoding, token for
token, in the compute mode `load_target` measures and chooses on this machine (as a replica does).

Engines: the engine's defaults (tree + prompt lookup + the cross-request suffix index + cost-aware pruning, with
its verify costs measured here) and the demo's settings (a fixed tree, nothing else), each against the plain
engine on the same target. Prompts: held-out ShareGPT first turns (English and code) and the code-rewrite
prompts (the answer quotes its input), in one process, one request at a time. The CPU kind is what the kernels
run: set ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 (`make exactness
CPU_ISA=avx2`) to run AVX2 kernels on an AVX-512 machine; the JSON line says which were asked for.

Exits 1 on any mismatch, naming the prompt and the first differing token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adaptive_eagle.checkpoint import load_head  # noqa: E402
from adaptive_eagle.engine import EngineConfig, SpeculativeEngine  # noqa: E402
from adaptive_eagle.targets import load_target  # noqa: E402
from adaptive_eagle.trace import SamplingParams  # noqa: E402
from adaptive_eagle_cli.demo.config import ENGINE as DEMO_ENGINE  # noqa: E402
from bench.decode import SHIPPED, code_rewrite_prompts  # noqa: E402
from trainer import data as D  # noqa: E402

ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS")


def prompt_sets(conversations, n: int) -> dict[str, list[str]]:
    return {"english": D.first_user_messages(conversations, n, domains=["english"], split="heldout"),
            "code": D.first_user_messages(conversations, n, domains=["code"], split="heldout"),
            "code-rewrite": code_rewrite_prompts(conversations, n)}


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12, help="prompts per set (default 12)")
    ap.add_argument("--max-new", type=int, default=128, help="tokens per request (default 128)")
    ap.add_argument("--head", type=Path, default=SHIPPED)
    args = ap.parse_args()
    if args.prompts < 1 or args.max_new < 1:
        ap.error("--prompts and --max-new must be >= 1")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    target = load_target()
    loaded = load_head(args.head, target, device=target.device)
    print(f"target compute: {target.compute}; {target.compute_choice.reason}", file=sys.stderr)
    plain = SpeculativeEngine(target, None, EngineConfig.plain())
    engines = {"default": SpeculativeEngine(target, loaded.head, EngineConfig(calibration_dir=""),
                                            head_version=loaded.meta.version),
               "demo": SpeculativeEngine(target, loaded.head, EngineConfig(**DEMO_ENGINE),
                                         head_version=loaded.meta.version)}
    sets = prompt_sets(list(D.load_sharegpt()), args.prompts)
    sp = SamplingParams(max_tokens=args.max_new)
    checked, mismatches, tokens = 0, [], 0
    with torch.inference_mode():
        for name, prompts in sets.items():
            for i, p in enumerate(prompts):
                ref = plain.generate(p, sp).token_ids
                for row, engine in engines.items():
                    out = engine.generate(p, sp).token_ids
                    checked, tokens = checked + 1, tokens + len(out)
                    if out != ref:
                        k = first_difference(out, ref)
                        mismatches.append({"set": name, "prompt": i, "engine": row, "first_difference": k})
                        print(f"MISMATCH {name} #{i} ({row}): first difference at token {k}", file=sys.stderr)
                print(f"{name} {i + 1}/{len(prompts)} checked, {len(mismatches)} mismatches so far", file=sys.stderr)
    result = {"checked": checked, "mismatches": len(mismatches), "tokens": tokens, "max_new": args.max_new,
              "sets": {k: len(v) for k, v in sets.items()}, "compute": target.compute,
              "isa_env": {k: os.environ[k] for k in ISA_ENV if k in os.environ} or "native",
              "cpu_flags": sorted({f for f in _cpu_flags() if f.startswith(("avx512", "amx", "avx2"))}),
              "wall_s": round(time.perf_counter() - t0, 1), "details": mismatches}
    print(json.dumps(result))
    sys.exit(1 if mismatches else 0)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


if __name__ == "__main__":
    main()
