"""SGLang check (a GPU machine with `adaptive-eagle[sglang]` installed; run by ops/gpu_check.sh).

Serves SmolLM2 through SGLang twice, without drafting and with EAGLE-3 and the shipped head, through this
project's SGLang backend, and checks what only a running server can show:
1. greedy equality: every prompt's output ids with EAGLE-3 equal those without drafting, token for token
   (streamed through the backend, so the stream assembly is checked too);
2. accept-length metrics: each finished answer's spec_* fields agree with one another (accept length =
   completion tokens / verify steps, histogram total = verify steps, histogram-weighted sum = correct
   drafts, proposed = verify steps x (num_draft_tokens - 1)) and are labelled with the head's version;
3. the draft swap in place: to a copy of the shipped head whose lm_head rows are rolled by one (same
   config and vocabulary, so it loads in place; its drafts are mostly wrong): the target's checksum is
   unchanged, the draft's changed, the label moved, the output is unchanged (lossless) and the accept
   length falls; swapping back restores the draft's checksum and the accept length.
Prints a table and ends with one JSON line; exits 1 when a check fails.
Owns: nothing the project imports; a check script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from adaptive_eagle.cli import SHIPPED_HEAD  # noqa: E402
from adaptive_eagle.targets import materialize_builtin  # noqa: E402
from serving.sglang_backend import SGLangConfig, launch_sglang, stop_process  # noqa: E402
from trainer import data as D  # noqa: E402


def chat_ids(tok, text: str) -> list[int]:
    """Token ids of one user turn with the generation prompt (transformers 5 returns a BatchEncoding)."""
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return [int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)]


def generate(client: httpx.Client, ids: list[int], max_new: int) -> dict:
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"temperature": 0.0,
                                                                          "max_new_tokens": max_new}})
    r.raise_for_status()
    return r.json()


def _plain_args(cfg: SGLangConfig) -> list[str]:
    """The same target without drafting: SGLang's own plain decoding."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path, "--host", cfg.host,
            "--port", str(cfg.port), *cfg.extra_args]


def serve_plain(cfg: SGLangConfig, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    proc = launch_sglang(cfg, args=_plain_args(cfg))
    try:
        with httpx.Client(base_url=cfg.base_url, timeout=cfg.timeout_s) as client:
            return [generate(client, ids, max_new)["output_ids"] for ids in prompts]
    finally:
        stop_process(proc, 60)


def spec_problems(meta: dict, version: str, draft_tokens: int) -> list[str]:
    """What in one finished answer's meta_info disagrees with the 0.5.23 definitions."""
    problems = []
    if meta.get("weight_version") != version:
        problems.append(f"weight_version {meta.get('weight_version')!r}, expected {version!r}")
    verify, hist = meta.get("spec_verify_ct"), meta.get("spec_correct_drafts_histogram") or []
    if not verify:
        return problems + ["no spec_verify_ct: the request did not decode speculatively"]
    if abs(meta["spec_accept_length"] - meta["completion_tokens"] / verify) > 1e-6:
        problems.append("spec_accept_length != completion_tokens / spec_verify_ct")
    if sum(hist) != verify:
        problems.append(f"histogram counts {sum(hist)} steps, spec_verify_ct {verify}")
    if sum(k * n for k, n in enumerate(hist)) != meta.get("spec_num_correct_drafts"):
        problems.append("histogram-weighted sum != spec_num_correct_drafts")
    if meta.get("spec_num_proposed_drafts") != verify * draft_tokens:
        problems.append("spec_num_proposed_drafts != spec_verify_ct x (num_draft_tokens - 1)")
    return problems


def serve_with(backend, server, prompts: list[list[int]], max_new: int, version: str) -> dict:
    """Every prompt through the backend (streamed): output ids, accept lengths, metric problems."""
    from serving.messages import DecodeRequest

    outs, accepts, problems = [], [], []
    for i, ids in enumerate(prompts):
        req = DecodeRequest(request_id=f"{version}-{i}", prompt=tuple(ids), max_tokens=max_new)
        items = list(backend.stream(req, ids, capture=False))
        result = items[-1]
        outs.append(list(result.token_ids))
        accepts.append(result.trace.accept_length_mean)
        answer = generate(server, ids, max_new)  # the same request, not streamed: its meta_info
        if answer["output_ids"] != outs[-1]:
            problems.append(f"prompt {i}: the streamed tokens differ from the non-streamed answer's")
        problems += [f"prompt {i}: {p}" for p in spec_problems(answer["meta_info"], version,
                                                              backend.cfg.num_draft_tokens - 1)]
    return {"outputs": outs, "accept": statistics.mean(accepts), "problems": problems}


def rolled_copy(registry, version: str) -> str:
    """A copy of `version` whose lm_head rows are rolled by one: same config and d2t, drafts mostly wrong."""
    import torch

    from adaptive_eagle.checkpoint import HeadMeta, load_head

    loaded = load_head(registry.get(version))
    loaded.head.lm_head.weight.data = torch.roll(loaded.head.lm_head.weight.data, 1, 0)
    meta = HeadMeta.new(f"{version}-rolled", loaded.meta.target_name, loaded.meta.target_fingerprint, parent=version)
    return registry.register(loaded.head, meta, dtype=loaded.head.lm_head.weight.dtype)


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--sglang-arg", action="append", default=[], help="one more launch_server argument (repeat)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from adaptive_eagle.registry import HeadRegistry
    from serving.sglang_backend import SGLangBackend
    from serving.sglang_swap import WeightSession

    model = materialize_builtin("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    texts = D.first_user_messages(D.load_sharegpt(), args.prompts, domains=["english", "code"], split="heldout")
    prompts = [chat_ids(tok, t) for t in texts]
    registry = HeadRegistry.create(Path(tempfile.mkdtemp(prefix="sglang-check-")) / "registry")
    head = registry.add(SHIPPED_HEAD)
    rolled = rolled_copy(registry, head)
    cfg = SGLangConfig(model_path=str(model), draft_model_path=str(registry.get(head)), weight_version=head,
                       port=args.port, launch=True, extra_args=tuple(a for s in args.sglang_arg for a in s.split()))
    plain = serve_plain(cfg, prompts, args.max_new)
    proc = launch_sglang(cfg)
    backend = SGLangBackend(cfg, tok, registry, head, process=proc)
    checks, runs = {}, {}
    try:
        server = httpx.Client(base_url=cfg.base_url, timeout=cfg.timeout_s)
        session = WeightSession(server)
        sums0 = session.checksums()
        runs[head] = serve_with(backend, server, prompts, args.max_new, head)
        swap = backend.swap_head(rolled)
        sums1 = session.checksums()
        runs[rolled] = serve_with(backend, server, prompts, args.max_new, rolled) if swap.ok else None
        back = backend.swap_head(head)
        sums2 = session.checksums()
        runs["back"] = serve_with(backend, server, prompts, args.max_new, head) if back.ok else None
    finally:
        backend.close()
        stop_process(proc, 60)
    spec = runs[head]
    mismatches = [i for i, (a, b) in enumerate(zip(plain, spec["outputs"])) if a != b]
    checks["greedy_equal"] = not mismatches
    checks["metrics_consistent"] = not spec["problems"]
    checks["swap_in_place"] = swap.ok and "in place" in swap.message
    checks["target_unchanged"] = sums0.target == sums1.target == sums2.target
    checks["draft_changed"] = sums1.draft != sums0.draft
    checks["draft_restored"] = sums2.draft == sums0.draft
    after, again = runs[rolled], runs["back"]
    checks["lossless_after_swap"] = after is not None and after["outputs"] == plain
    checks["accept_falls_with_rolled_head"] = after is not None and after["accept"] < spec["accept"] - 0.1
    checks["accept_restored"] = again is not None and abs(again["accept"] - spec["accept"]) < 0.05
    checks["labels_after_swaps"] = (after is not None and again is not None
                                    and not after["problems"] + again["problems"])
    for i, (a, b) in enumerate(zip(plain, spec["outputs"])):
        where = "ok" if a == b else f"DIFF at token {first_difference(a, b)}"
        print(f"{i:3d} {where:<18} {len(b):4d} tokens")
    for p in spec["problems"][:10]:
        print("metrics:", p)
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    out = {"prompts": len(prompts), "mismatches": len(mismatches), "accept_length": round(spec["accept"], 3),
           "accept_length_rolled_head": round(after["accept"], 3) if after else None,
           "accept_length_back": round(again["accept"], 3) if again else None, "swap": swap.message,
           "swap_back": back.message, "swap_ms": round(swap.install_ms, 1), "swap_back_ms": round(back.install_ms, 1),
           "checks": checks}
    print(json.dumps(out))
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
