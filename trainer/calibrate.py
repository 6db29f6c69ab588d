"""`adaptive-eagle calibrate-head`: measure how often a head's drafts are accepted, by draft
probability, and ship that calibration inside the head's head.json.

Owns: decoding a few training-split prompts with the reference engine and writing the engine's
acceptance calibration into `metrics.calibration[<target fingerprint>]`. Why: the engine sizes
each draft tree by expected acceptance per millisecond; a head that arrives uncalibrated trusts its
own (over-confident) probabilities and over-drafts its first requests. A calibration in head.json
travels with the head to every server, so the first request after a start or a swap is sized right.
Training-split prompts only: the held-out split stays for benchmarks and evaluation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from adaptive_eagle.targets import Target, load_target
from trainer import data as D


def training_prompts(n: int, domains=("english",), max_chars: int = 1200) -> list[str]:
    """The first user message of the first `n` training-split conversations of `domains`."""
    return D.first_user_messages(D.load_sharegpt(), n, domains=domains, split="train", max_chars=max_chars)


def run_calibrate_head(head_dir: Path, target: Target | str | None = None, n_prompts: int = 16,
                       max_tokens: int = 96, domains=("english",), log: Callable[[str], None] = print) -> dict:
    """Decode `n_prompts` prompts with the head (cost-aware engine on flat pinned costs, greedy) and write the learned
    calibration into head.json; returns {"prompts", "observations", "accept_length_mean"}."""
    from adaptive_eagle import checkpoint as C
    from adaptive_eagle.costmodel import PinnedCosts
    from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
    from adaptive_eagle.trace import SamplingParams

    head_dir = Path(head_dir)
    if not isinstance(target, Target):
        target = load_target(target or C.HeadMeta.from_json((head_dir / C.META_FILE).read_text()).target_name)
    loaded = C.load_head(head_dir, target, device=target.device)
    # start from the head's own probabilities, not from a cached or shipped calibration; flat pinned costs
    # verify whole trees, so every probability bucket is observed (a machine's timings would prune the
    # unlikely nodes away) and the calibration is the same on any machine, under any load
    engine = SpeculativeEngine(target, loaded.head, EngineConfig(calibration_dir="", pinned_costs=PinnedCosts.flat()),
                               head_version=loaded.meta.version)
    prompts = training_prompts(n_prompts, domains)
    accept = []
    for i, prompt in enumerate(prompts, 1):
        res = engine.generate(prompt, SamplingParams(max_tokens=max_tokens))
        accept.append(res.accept_length_mean)
        log(f"  prompt {i}/{len(prompts)}: {len(res.token_ids)} tokens, accept length {res.accept_length_mean:.2f}")
    cal = engine.calibration
    meta = C.HeadMeta.from_json((head_dir / C.META_FILE).read_text())
    shipped = dict(meta.metrics.get("calibration") or {})
    shipped[target.fingerprint] = cal.to_dict()
    C.update_metrics(head_dir, {"calibration": shipped})
    summary = {"prompts": len(prompts), "observations": cal.observations,
               "accept_length_mean": sum(accept) / max(1, len(accept)), "compute": target.compute}
    log(f"calibration written to {head_dir / C.META_FILE} for target {target.fingerprint} "
        f"({cal.observations:.0f} observations)")
    return summary
