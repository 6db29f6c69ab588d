"""SGLang check (GPU machine with `adaptive-eagle[sglang]` installed): serve the shipped head through
SGLang's EAGLE-3 and check greedy equality with SGLang's own non-speculative output, then swap the
draft through the weight update with the draft selector and check acceptance holds.

Run by ops/gpu_check.sh. Prints a table and ends with one JSON line: prompts, mismatches,
accept_length (SGLang's spec_accept_length, mean), accept_length_after_swap, swap_ok.
Owns: nothing the project imports; a check script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from adaptive_eagle.cli import SHIPPED_HEAD  # noqa: E402
from adaptive_eagle.targets import materialize_builtin  # noqa: E402
from serving.sglang_backend import SGLangConfig, launch_sglang  # noqa: E402
from trainer import data as D  # noqa: E402


def generate(client: httpx.Client, ids: list[int], max_new: int) -> dict:
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"temperature": 0.0,
                                                                          "max_new_tokens": max_new}})
    r.raise_for_status()
    return r.json()


def serve(cfg: SGLangConfig, prompts: list[list[int]], max_new: int, plain: bool) -> list[dict]:
    """Greedy outputs of SGLang serving the target with EAGLE-3 (plain=False) or without drafting."""
    if plain:  # SGLang's own non-speculative decoding of the same target: the launch without EAGLE-3 args
        cfg = cfg.model_copy(update={"extra_args": ()})
    proc = launch_sglang(cfg, args=_plain_args(cfg) if plain else None)
    client = httpx.Client(base_url=cfg.base_url, timeout=cfg.timeout_s)
    try:
        return [generate(client, ids, max_new) for ids in prompts]
    finally:
        proc.terminate()
        proc.wait(60)


def _plain_args(cfg: SGLangConfig) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path, "--host", cfg.host,
            "--port", str(cfg.port)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--port", type=int, default=30000)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model = materialize_builtin("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    texts = D.first_user_messages(D.load_sharegpt(), args.prompts, domains=["english", "code"], split="heldout")
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    cfg = SGLangConfig(model_path=str(model), draft_model_path=str(SHIPPED_HEAD), port=args.port)
    plain = serve(cfg, prompts, args.max_new, plain=True)
    spec = serve(cfg, prompts, args.max_new, plain=False)
    mismatches = sum(a["text"] != b["text"] for a, b in zip(plain, spec))
    accept = [s["meta_info"].get("spec_accept_length") for s in spec if s["meta_info"].get("spec_accept_length")]
    # swap the draft to the same head through the weight update (draft selector): acceptance must hold
    import tempfile

    from adaptive_eagle.registry import HeadRegistry
    from serving.sglang_backend import SGLangBackend

    registry = HeadRegistry.create(Path(tempfile.mkdtemp(prefix="sglang-check-")) / "registry")
    version = registry.add(SHIPPED_HEAD)
    proc = launch_sglang(cfg)
    try:
        backend = SGLangBackend(cfg, tok, registry=registry, head_version=version)
        swap = backend.swap_head(version)
        client = httpx.Client(base_url=cfg.base_url, timeout=cfg.timeout_s)
        after = [generate(client, ids, args.max_new)["meta_info"].get("spec_accept_length") or 1.0 for ids in prompts]
    finally:
        proc.terminate()
        proc.wait(60)
    for i, (a, b) in enumerate(zip(plain, spec)):
        print(f"{i:3d} {'ok  ' if a['text'] == b['text'] else 'DIFF'} accept {b['meta_info'].get('spec_accept_length')}")
    out = {"prompts": len(prompts), "mismatches": mismatches,
           "accept_length": round(statistics.mean(accept), 3) if accept else None,
           "accept_length_after_swap": round(statistics.mean(after), 3), "swap_ok": swap.ok, "swap": swap.message}
    print(json.dumps(out))
    sys.exit(1 if mismatches or not swap.ok else 0)


if __name__ == "__main__":
    main()
