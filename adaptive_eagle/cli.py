"""The `adaptive-eagle` command line. Thin: parses options, calls the packages, prints results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(
    help="adaptive-eagle: EAGLE-3 speculative decoding whose draft heads keep adapting to live traffic.\n\n"
    "Train and evaluate draft heads for a target model; later waves add serving, the feature store, "
    "the near-line trainer and the promotion policy.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

SHIPPED_HEAD = Path(__file__).resolve().parent.parent / "heads" / "smollm2-135m-english-v2"


def _mount_store() -> None:
    from feature_store.cli import store_app  # imports only typer at module level

    app.add_typer(store_app, name="store")


_mount_store()


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.command("train-head")
def train_head(
    out: Path = typer.Option(..., "--out", "-o", help="version directory to write the trained head to"),
    run_dir: Optional[Path] = typer.Option(None, help="resumable run state (default: <cache>/runs/<out name>)"),
    target: str = typer.Option("smollm2-135m", help="built-in target name or local HF model directory"),
    aux_layers: Optional[str] = typer.Option(None, help="comma-separated aux layer ids (input of layer k); "
                                              "default 2,L//2,L-3"),
    init_head: Optional[Path] = typer.Option(None, help="fine-tune this head instead of starting fresh"),
    domains: str = typer.Option("english", help="comma-separated ShareGPT domains: english,code,math,non_english"),
    data_jsonl: Optional[Path] = typer.Option(None, help="train on JSONL {id, conversations:[{role, content}]}"),
    token_budget: int = typer.Option(2_000_000, help="stop after this many training tokens"),
    minutes: Optional[float] = typer.Option(None, help="stop after this many minutes (resumable)"),
    lr: float = typer.Option(5e-4, help="peak learning rate (warmup, then cosine to 10%)"),
    max_len: int = typer.Option(512, help="tokens per conversation"),
    batch_tokens: int = typer.Option(4096, help="padded tokens per batch"),
    max_loss_rows: int = typer.Option(1024, help="positions scored per TTT step; 0 = all"),
    draft_vocab_size: Optional[int] = typer.Option(None, help="default: smallest size covering --vocab-coverage"),
    vocab_coverage: float = typer.Option(0.97, help="assistant-token coverage the draft vocab must reach"),
    num_experts: int = typer.Option(1, help="1 = dense head; >1 = MoE-routed MLP"),
    warm_start: str = typer.Option("full", help="full: lm_head rows, norms and a target decoder layer; "
                                   "output: lm_head + norm; none: random"),
    resume: bool = typer.Option(True, help="continue the run in --run-dir when it exists"),
    eval_every: int = typer.Option(100, help="steps between held-out acceptance evaluations"),
    seed: int = typer.Option(0),
) -> None:
    """Train an EAGLE-3 draft head with training-time test (7 unrolled steps) on ShareGPT or JSONL data.

    Shows loss and per-step top-1 agreement, prints held-out 0-α…6-α every --eval-every steps, checkpoints the run every 5 minutes (stop any time, rerun to resume), and writes the head in SGLang's EAGLE-3 layout plus head.json.
    """
    from pydantic import ValidationError

    from trainer.offline import TrainHeadConfig
    from trainer.train_head import run_train_head

    try:
        cfg = TrainHeadConfig(
            target=target, aux_layer_ids=[int(k) for k in aux_layers.split(",")] if aux_layers else None,
            domains=[d.strip() for d in domains.split(",") if d.strip()],
            data_jsonl=str(data_jsonl) if data_jsonl else None, token_budget=token_budget,
            time_budget_min=minutes, lr=lr, max_len=max_len, batch_tokens=batch_tokens,
            max_loss_rows=max_loss_rows or None, draft_vocab_size=draft_vocab_size, vocab_coverage=vocab_coverage,
            num_experts=num_experts, warm_start=warm_start, eval_every=eval_every, seed=seed,
        )
    except ValidationError as e:
        _fail(f"bad option: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}")
    from adaptive_eagle.targets import cache_dir

    run = run_dir or cache_dir() / "runs" / out.name
    result = run_train_head(cfg, run, out_dir=out, init_head=init_head, resume=resume)
    ev = result["heldout_english"]
    typer.echo("held-out acceptance after training:")
    typer.echo("  " + "  ".join(f"{j}-α {a:.3f}" for j, a in enumerate(ev["alpha"])))
    typer.echo(f"  expected accept length (chain, bonus included) {ev['accept_length']:.3f}")
    typer.echo(json.dumps(result, default=str))


@app.command("eval-head")
def eval_head(
    head: Path = typer.Argument(SHIPPED_HEAD, help="head version directory"),
    target: Optional[str] = typer.Option(None, help="default: the head's target_name"),
    domains: str = typer.Option("english,code,math", help="held-out domains to evaluate"),
    convs: int = typer.Option(48, help="held-out conversations per domain"),
    max_len: int = typer.Option(1024, help="tokens per conversation"),
    update_meta: bool = typer.Option(False, help="write the results into head.json metrics"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Per-position acceptance (0-α…6-α) and expected accept length on held-out ShareGPT domains."""
    from adaptive_eagle.checkpoint import HeadValidationError
    from trainer.train_head import run_eval_head

    if not (head / "head.json").exists():
        _fail(f"{head}: not a head version directory (no head.json)")
    try:
        res = run_eval_head(head, target, [d.strip() for d in domains.split(",")], convs, max_len, update_meta,
                            log=(lambda s: None) if as_json else typer.echo)
    except HeadValidationError as e:
        _fail(f"head refused: {e}")
    if as_json:
        typer.echo(json.dumps(res))


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
        _fail(f"unknown format {fmt!r}; supported: speculators")
    try:
        typer.echo(str(export_speculators(head, out)))
    except (HeadValidationError, FileExistsError, ValueError) as e:
        _fail(str(e))


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
        _fail(str(e))
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
        _fail(str(e))
    tgt = load_target(target, device=device)
    draft, version = None, None
    if head.lower() != "none":
        try:
            loaded = load_head(Path(head), tgt, device=tgt.device)
        except (HeadValidationError, FileNotFoundError) as e:
            _fail(f"head refused: {e}")
        draft, version = loaded.head.to(tgt.dtype), loaded.meta.version
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    try:
        engine = SpeculativeEngine(tgt, draft, cfg, head_version=version)
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
        _fail(str(e))
    summary = {"text": res.text, "token_ids": res.token_ids, "accept_length_mean": round(res.accept_length_mean, 3),
               "tokens_per_s": round(res.tokens_per_s, 2), "head_version": version, "finish_reason": res.finish_reason,
               "target_compute": tgt.compute}
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.secho(f"[{len(res.token_ids)} tokens, {res.tokens_per_s:.1f} tok/s, mean accept length "
                    f"{res.accept_length_mean:.2f}, head {version or 'none'}, target {tgt.compute}]",
                    fg=typer.colors.CYAN, err=True)


@app.command("target-info")
def target_info(target: str = typer.Argument("smollm2-135m", help="built-in name or local HF directory")) -> None:
    """Load a target (dequantising the built-in GGUF once) and print its facts."""
    from adaptive_eagle.targets import load_target

    typer.echo(json.dumps(_target_facts(load_target(target)), indent=2))


def _target_facts(t) -> dict:
    from adaptive_eagle.targets import sglang_config_layer_ids

    c = t.config
    return {
        "name": t.name, "path": str(t.path), "fingerprint": t.fingerprint, "layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "dtype": str(t.dtype),
        "aux_layer_ids (input of layer k)": list(t.aux_layer_ids),
        "sglang eagle_aux_hidden_state_layer_ids": sglang_config_layer_ids(t.aux_layer_ids),
    }


@app.command("data-stats")
def data_stats(jsonl: Optional[Path] = typer.Option(None, help="a JSONL file instead of ShareGPT")) -> None:
    """Conversations per domain and split in ShareGPT (or a JSONL file)."""
    from trainer import data as D

    convs = list(D.load_jsonl(jsonl) if jsonl else D.load_sharegpt())
    rows = {d: {"train": 0, "heldout": 0} for d in D.DOMAINS}
    for c in convs:
        rows[c.domain][D.split_of(c.id)] += 1
    typer.echo(f"{'domain':12s} {'train':>7s} {'heldout':>8s}")
    for d, r in rows.items():
        typer.echo(f"{d:12s} {r['train']:7d} {r['heldout']:8d}")
    typer.echo(f"{'total':12s} {sum(r['train'] for r in rows.values()):7d} {sum(r['heldout'] for r in rows.values()):8d}")


@app.command("demo")
def demo(
    quick: bool = typer.Option(True, help="small held-out samples (a few minutes on 2 CPU cores)"),
) -> None:
    """The main job. Today: the foundation — the target, the shipped head decoding a prompt next to
    plain decoding, and its held-out acceptance per domain (drift shows as code/maths).

    The adaptive loop (servers → feature store → near-line trainer → promotion) arrives with later waves."""
    import time as _time

    import torch

    from adaptive_eagle.checkpoint import load_head
    from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
    from adaptive_eagle.targets import load_target
    from adaptive_eagle.trace import SamplingParams

    typer.secho("adaptive-eagle demo — the adaptive loop (serving, feature store → trainer → promotion policy) is "
                "not wired yet; this shows the foundation it runs on.\n", bold=True)
    if not (SHIPPED_HEAD / "head.json").exists():
        _fail("no shipped head found; train one with `adaptive-eagle train-head --out heads/my-head`")
    tgt = load_target()
    typer.echo(json.dumps(_target_facts(tgt), indent=2))
    loaded = load_head(SHIPPED_HEAD, tgt)
    head = loaded.head.to(tgt.dtype)
    prompt = "Give me three tips for writing clear emails."
    sp = SamplingParams(max_tokens=96)
    typer.secho(f"\nprompt: {prompt}", bold=True)
    rows = []
    for name, eng in (("plain", SpeculativeEngine(tgt, None, EngineConfig(prompt_lookup=False))),
                      (f"EAGLE-3 {loaded.meta.version}", SpeculativeEngine(tgt, head, EngineConfig(),
                                                                           loaded.meta.version))):
        t0 = _time.perf_counter()
        with torch.inference_mode():
            res = eng.generate(prompt, sp)
        rows.append((name, res, _time.perf_counter() - t0))
    typer.echo(rows[-1][1].text.strip() + "\n")
    for name, res, dt in rows:
        typer.echo(f"  {name:32s} {len(res.token_ids) / dt:6.1f} tok/s   mean accept length {res.accept_length_mean:.2f}")
    a, b = rows[0][1].token_ids, rows[1][1].token_ids
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None:
        typer.echo("  identical output: yes (token for token)")
    else:  # show how close the target itself was to a tie there, in its own logits
        with torch.inference_mode():
            ids = torch.tensor([eng.encode(prompt) + a[:k]], device=tgt.device)
            z = tgt.model(ids).logits[0, -1].float()
        typer.echo(f"  identical output: no, from token {k}: plain picked {a[k]}, speculative {b[k]}; the target's "
                   f"logits for the two differ by {abs(float(z[a[k]] - z[b[k]])):.3f} (a bf16 near-tie that a "
                   "one-token and a tree forward round differently; float32 runs match exactly, see the tests)")
    typer.secho(f"\nheld-out acceptance of {SHIPPED_HEAD.name} per domain:", bold=True)
    from trainer.train_head import run_eval_head

    run_eval_head(SHIPPED_HEAD, tgt, ("english", "code", "math"), 8 if quick else 48, 512, log=typer.echo)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
