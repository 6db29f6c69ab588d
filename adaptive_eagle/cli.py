"""The core's commands: generate, target-info, export-head, import-head. Thin: parses options, calls
adaptive_eagle, prints results.

Imports nothing from trainer, feature_store, serving or policies (they build on the core); the
`adaptive-eagle` program that mounts these next to the packages' commands is adaptive_eagle_cli.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(
    help="adaptive-eagle core: decode with a draft head, inspect a target, move heads between serving stacks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

SHIPPED_HEAD = Path(__file__).resolve().parent.parent / "heads" / "smollm2-135m-english-v2"


def fail(msg: str) -> None:
    """Print `error: msg` to stderr and exit 2 (every command's refusal)."""
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.command("export-head")
def export_head(
    head: Path = typer.Argument(..., help="head version directory"),
    out: Path = typer.Argument(..., help="output directory"),
    fmt: str = typer.Option("speculators", "--format", help="speculators (vLLM)"),
) -> None:
    """Export a head for another serving stack (vLLM `speculators` layout)."""
    from adaptive_eagle.checkpoint import HeadValidationError
    from adaptive_eagle.interop import export_speculators

    if fmt != "speculators":
        fail(f"unknown format {fmt!r}; supported: speculators")
    try:
        typer.echo(str(export_speculators(head, out)))
    except (HeadValidationError, FileExistsError, ValueError) as e:
        fail(str(e))


@app.command("import-head")
def import_head(
    src: Path = typer.Argument(..., help="SpecForge / official EAGLE-3 checkpoint directory"),
    out: Path = typer.Argument(..., help="version directory to create"),
    target: Optional[str] = typer.Option(None, help="validate against this target and record its fingerprint"),
) -> None:
    """Import a SpecForge / official EAGLE-3 head into this project's layout (validated)."""
    from adaptive_eagle.checkpoint import HeadValidationError
    from adaptive_eagle.interop import import_specforge
    from adaptive_eagle.targets import load_target

    tgt = load_target(target) if target else None
    try:
        meta = import_specforge(src, out, target=tgt)
    except (HeadValidationError, FileExistsError, ValueError) as e:
        fail(str(e))
    typer.echo(meta.to_json())


@app.command("generate")
def generate(
    prompt: str = typer.Argument(..., help="the user message (chat-templated) to answer"),
    head: str = typer.Option(str(SHIPPED_HEAD), help="head version directory, or 'none' for plain decoding"),
    target: str = typer.Option("smollm2-135m", help="built-in target name or local HF model directory"),
    temperature: float = typer.Option(0.0, help="0 = greedy; > 0 samples (lossless either way)"),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    max_tokens: int = typer.Option(256),
    depth: int = typer.Option(5, help="draft tree depth"),
    topk: int = typer.Option(4, help="children per expanded node"),
    num_draft_tokens: int = typer.Option(16, help="tree nodes verified per target forward"),
    prompt_lookup: bool = typer.Option(True, help="merge suffix-match drafts from the context into the tree"),
    cost_aware: bool = typer.Option(True, "--cost-aware/--fixed-tree",
                                    help="verify only the part of each tree that pays on this machine"),
    stop: Optional[list[str]] = typer.Option(None, help="stop string (repeatable)"),
    seed: Optional[int] = typer.Option(None),
    device: str = typer.Option("auto", help="auto (CUDA when present), cpu, cuda, cuda:1, ..."),
    compute: str = typer.Option("auto", help="auto: the fastest exact mode measured on this machine; or bf16, fp32, "
                                "fp32+fp16-weights, fp16 (bf16/fp16 are lossless only up to their rounding)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Generate with EAGLE-3 speculative decoding; prints the text and a one-line summary."""
    import torch

    from adaptive_eagle.checkpoint import HeadValidationError, load_head
    from adaptive_eagle.engine import EngineConfig, GenerationError, SpeculativeEngine
    from adaptive_eagle.targets import load_target
    from adaptive_eagle.trace import SamplingParams

    try:
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed)
        cfg = EngineConfig(depth=depth, topk=topk, num_draft_tokens=num_draft_tokens, prompt_lookup=prompt_lookup,
                           cost_aware=cost_aware)
    except ValueError as e:
        fail(str(e))
    try:
        tgt = load_target(target, device=device, compute=compute)
    except ValueError as e:
        fail(str(e))
    draft, version = None, None
    if head.lower() != "none":
        try:
            draft = load_head(Path(head), tgt, device=tgt.device)  # the engine prepares it for tgt's compute mode
        except (HeadValidationError, FileNotFoundError) as e:
            fail(f"head refused: {e}")
        version = draft.meta.version
    else:
        cfg = dataclasses.replace(cfg, suffix_drafting=False)  # one request: nothing to draft from
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    try:
        engine = SpeculativeEngine(tgt, draft, cfg)
        if as_json:
            res = engine.generate(prompt, sampling, stop=stop, generator=gen)
        else:
            res, ids, shown = None, [], ""
            for new, final in engine.stream(prompt, sampling, stop=stop, generator=gen):
                if final is not None:
                    res = final
                    break
                ids += [t for t in new if t not in engine.eos_ids]
                text = tgt.tokenizer.decode(ids, skip_special_tokens=True)
                typer.echo(text[len(shown):], nl=False)
                shown = text
            typer.echo("")
    except GenerationError as e:
        fail(str(e))
    summary = {"text": res.text, "token_ids": res.token_ids, "accept_length_mean": round(res.accept_length_mean, 3),
               "tokens_per_s": round(res.tokens_per_s, 2), "head_version": version, "finish_reason": res.finish_reason,
               "target_compute": res.compute, "lossless": res.lossless}
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.secho(f"[{len(res.token_ids)} tokens, {res.tokens_per_s:.1f} tok/s, mean accept length "
                    f"{res.accept_length_mean:.2f}, head {version or 'none'}, target {res.compute}: {res.lossless}]",
                    fg=typer.colors.CYAN, err=True)


@app.command("target-info")
def target_info(
    target: str = typer.Argument("smollm2-135m", help="built-in name or local HF directory"),
    compute: str = typer.Option("auto", help="auto: the fastest exact mode measured on this machine; or bf16, fp32, "
                                "fp32+fp16-weights, fp16"),
    remeasure: bool = typer.Option(False, help="time the compute modes again and replace the cached table"),
) -> None:
    """Load a target (dequantising the built-in GGUF once) and print its facts, the compute modes
    measured on this machine and the one decoding uses (with why, and whether it is exact)."""
    from adaptive_eagle.targets import describe_compute, load_target

    try:
        tgt = load_target(target, compute=compute)
        if remeasure:  # re-time the modes, then load again so that the choice reflects the new table
            describe_compute(tgt, refresh=True)
            tgt = load_target(target, compute=compute)
    except ValueError as e:
        fail(str(e))
    facts = {**target_facts(tgt), "compute": describe_compute(tgt, measure=True)}
    typer.echo(json.dumps(facts, indent=2))


def target_facts(t) -> dict:
    """What `target-info` prints about a loaded target (the demo prints it too)."""
    from adaptive_eagle.targets import sglang_config_layer_ids

    c = t.config
    return {
        "name": t.name, "path": str(t.path), "fingerprint": t.fingerprint, "layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "dtype": str(t.dtype),
        "target_compute": t.compute, "lossless": t.lossless,
        "aux_layer_ids (input of layer k)": list(t.aux_layer_ids),
        "sglang eagle_aux_hidden_state_layer_ids": sglang_config_layer_ids(t.aux_layer_ids),
    }

