"""`adaptive-eagle train-head | eval-head | calibrate-head | data-stats`: the trainer's commands (mounted at top level
by adaptive_eagle_cli). Thin: parses options, calls trainer, prints results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from adaptive_eagle.cli import SHIPPED_HEAD, fail

MIN_LEN, MAX_LEN = 16, 32768  # trainer.offline.TrainHeadConfig.max_len's range
DEFAULT_BUCKETS = "0,512,1024,2048,4096,8192"  # trainer.positions.DEFAULT_EDGES (tested equal; torch-free here)

trainer_app = typer.Typer(help="Train and evaluate draft heads offline.", add_completion=False)


@trainer_app.command("train-head")
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
    sequence_parallel: int = typer.Option(1, help="1: train in this process; N > 1 (2..64): split every batch's "
                                          "rows by position over N Ray Train workers (each loads the target; a "
                                          "local Ray is started when none runs); dense heads only"),
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
            sequence_parallel=sequence_parallel,
        )
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(part) for part in err["loc"])  # empty for a check across options
        fail(f"bad option: {where + ': ' if where else ''}{err['msg']}")
    from adaptive_eagle.targets import cache_dir

    run = run_dir or cache_dir() / "runs" / out.name
    result = run_train_head(cfg, run, out_dir=out, init_head=init_head, resume=resume)
    ev = result["heldout_english"]
    typer.echo("held-out acceptance after training:")
    typer.echo("  " + "  ".join(f"{j}-α {a:.3f}" for j, a in enumerate(ev["alpha"])))
    typer.echo(f"  expected accept length (chain, bonus included) {ev['accept_length']:.3f}")
    typer.echo(json.dumps(result, default=str))


@trainer_app.command("eval-head")
def eval_head(
    head: str = typer.Argument(str(SHIPPED_HEAD), help="head version directory, or a version name with --registry"),
    target: Optional[str] = typer.Option(None, help="default: the head's target_name"),
    domains: str = typer.Option("english,code,math", help="domains to evaluate (stored traffic: its domain tags; "
                                "'all' for every tag)"),
    convs: int = typer.Option(48, help="held-out ShareGPT conversations per domain"),
    max_len: Optional[int] = typer.Option(None, help="tokens per conversation (default 1024); with --by-position "
                                          "the length of each long session (default 8192, the target's context)"),
    update_meta: bool = typer.Option(False, help="write the results into head.json metrics"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    root: Optional[Path] = typer.Option(None, "--root", help="replay on this local feature store's traffic"),
    store_config: Optional[Path] = typer.Option(None, "--store-config", help="... or this StoreConfig JSON"),
    redis_url: Optional[str] = typer.Option(None, "--redis-url", help="... or this Redis store"),
    window: Optional[str] = typer.Option(None, help="stored traffic of the last 30m, 6h, 2d, ... (default: all)"),
    records: int = typer.Option(200, min=1, help="at most this many of the newest stored records"),
    against: Optional[str] = typer.Option(None, help="comma-separated heads replayed on the same records"),
    registry: Optional[str] = typer.Option(None, help="head registry: look heads up as version names"),
    depth: int = typer.Option(5, min=1, max=16, help="replay tree depth (serving default)"),
    topk: int = typer.Option(4, min=1, max=16, help="replay tree top-k"),
    draft_tokens: int = typer.Option(16, min=1, max=128, help="replay tree nodes"),
    by_position: bool = typer.Option(False, "--by-position", help="slice acceptance by context position "
                                     "(--buckets). ShareGPT: scores --sessions long held-out sessions per domain, "
                                     "each consecutive held-out conversations chained into one chat of --max-len "
                                     "tokens, every position; stored traffic: each verify step by where it starts"),
    sessions: int = typer.Option(8, min=1, max=1000, help="long held-out sessions per domain with --by-position"),
    buckets: Optional[str] = typer.Option(None, help="position bucket edges for --by-position, default "
                                          f"{DEFAULT_BUCKETS} (0-512, 512-1k, 1-2k, 2-4k, 4-8k); buckets past "
                                          "--max-len are omitted"),
) -> None:
    """Acceptance of a draft head: on stored traffic (--root/--store-config/--redis-url) by acceptance
    replay of the serving tree against what the target committed, or else on held-out ShareGPT domains
    (per-position acceptance 0-α…6-α and expected chain accept length); --by-position slices either by
    where in the context the draft is made."""
    from adaptive_eagle.checkpoint import HeadValidationError

    from trainer.positions import parse_edges

    try:
        edges = parse_edges(buckets or DEFAULT_BUCKETS)
    except ValueError as e:
        fail(f"--buckets: {e}")
    if max_len is not None and not MIN_LEN <= max_len <= MAX_LEN:
        fail(f"--max-len {max_len}: allowed {MIN_LEN}..{MAX_LEN} tokens")
    if root is not None or store_config is not None or redis_url is not None:
        heads = [head] + [h.strip() for h in (against or "").split(",") if h.strip()]
        doms = None if domains.strip() == "all" else [d.strip() for d in domains.split(",")]
        _eval_on_store(heads, (store_config, root, redis_url), target, doms, window, records, registry,
                       (depth, topk, draft_tokens), as_json, edges if by_position else None)
        return
    from trainer.train_head import run_eval_head

    if not (Path(head) / "head.json").exists():
        fail(f"{head}: not a head version directory (no head.json)")
    length = max_len or (8192 if by_position else 1024)
    try:
        res = run_eval_head(Path(head), target, [d.strip() for d in domains.split(",")], convs, length, update_meta,
                            log=(lambda s: None) if as_json else typer.echo, by_position=by_position,
                            sessions=sessions, edges=edges)
    except HeadValidationError as e:
        fail(f"head refused: {e}")
    except ValueError as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(res))


def _eval_on_store(heads, store_opts, target, domains, window, records, registry, tree_opts, as_json,
                   edges=None) -> None:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from adaptive_eagle.checkpoint import HeadValidationError
    from adaptive_eagle.registry import RegistryError
    from feature_store.backend import StoreUnavailable
    from feature_store.config import StoreConfigError, store_config_from_options
    from trainer.evaluate import replay_store
    from trainer.replay import TreeParams

    try:
        cfg = store_config_from_options(*store_opts, prefix="ae")
    except StoreConfigError as e:
        fail(str(e))
    if cfg is None:
        fail("give --store-config, --root or --redis-url")
    try:
        with Progress(transient=True, disable=as_json) as bar:
            task = bar.add_task("replaying", total=None)
            report, facts = replay_store(heads, cfg, registry=registry, window=window, domains=domains, newest=records,
                                         tree=TreeParams(*tree_opts), target=target,
                                         progress=lambda done, total: bar.update(task, completed=done, total=total))
    except (StoreUnavailable, FileNotFoundError, HeadValidationError, RegistryError, ValueError) as e:
        fail(str(e))
    out = {**report.summary(edges), "store": facts}
    if as_json:
        typer.echo(json.dumps(out))
        return
    t = Table(title=f"acceptance replay on {facts['records']} stored records"
                    + (f" (last {window})" if window else "") + f", tree {tree_opts[0]}x{tree_opts[1]}/{tree_opts[2]}")
    for col in ("head", "domain", "records", "accept length", "p5 accept length", "0-α … 6-α"):
        t.add_column(col)
    for name, s in report.scores.items():
        t.add_row(name, "all", str(len(s.records)), f"{s.mean:.3f}", f"{s.quantile(0.05):.3f}",
                  " ".join(f"{a:.2f}" for a in s.alpha()))
        for d, ds in s.by_domain().items():
            t.add_row("", d or "untagged", str(len(ds.records)), f"{ds.mean:.3f}", f"{ds.quantile(0.05):.3f}", "")
    Console(width=160).print(t)
    if edges is not None:
        _position_table(out["heads"], Console(width=160))
    if report.skipped:
        typer.echo("skipped: " + ", ".join(f"{k}: {v}" for k, v in report.skipped.items()))


def _position_table(heads: dict, console) -> None:
    """The replay's by-position slice (ReplayReport.summary(edges)) of each head as one table."""
    from rich.table import Table

    t = Table(title="replay by context position")
    for col in ("head", "bucket", "verify steps", "accept length", "0-α … 6-α"):
        t.add_column(col)
    for name, s in heads.items():
        for k, b in enumerate(s["by_position"]):
            t.add_row(name if k == 0 else "", b["bucket"], str(b["steps"]), f"{b['accept_length']:.3f}",
                      " ".join(f"{a:.2f}" for a in b["alpha"]))
    console.print(t)


@trainer_app.command("calibrate-head")
def calibrate_head(
    head: Path = typer.Argument(SHIPPED_HEAD, help="head version directory"),
    target: Optional[str] = typer.Option(None, help="default: the head's target_name"),
    prompts: int = typer.Option(16, min=1, max=1000, help="training-split prompts to decode"),
    max_tokens: int = typer.Option(96, min=8, max=2048, help="tokens generated per prompt"),
    domains: str = typer.Option("english", help="ShareGPT domains the prompts come from"),
) -> None:
    """Measure the head's acceptance by draft probability on this target and write it into head.json,
    so servers size draft trees right from the first request after a start or a swap."""
    from adaptive_eagle.checkpoint import HeadValidationError
    from trainer.calibrate import run_calibrate_head

    if not (head / "head.json").exists():
        fail(f"{head}: not a head version directory (no head.json)")
    try:
        res = run_calibrate_head(head, target, prompts, max_tokens, [d.strip() for d in domains.split(",")],
                                 log=typer.echo)
    except HeadValidationError as e:
        fail(f"head refused: {e}")
    typer.echo(json.dumps(res))


@trainer_app.command("data-stats")
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


@trainer_app.command("regen-data")
def regen_data(
    out: Path = typer.Option(..., "--out", "-o", help="JSONL to append to (resumable: answered ids are skipped)"),
    target: str = typer.Option("smollm2-135m", help="built-in target name or local HF model directory"),
    domains: str = typer.Option("english", help="comma-separated ShareGPT domains: english,code,math,non_english"),
    conversations: int = typer.Option(2000, help="train-split prompts to answer"),
    heldout: int = typer.Option(48, help="held-out prompts to answer too (train-head evaluates on them)"),
    max_new_tokens: int = typer.Option(256, help="reply length limit (a cut reply ends at its last sentence)"),
    max_prompt_tokens: int = typer.Option(384, help="longer prompts are skipped"),
    batch: int = typer.Option(32, help="prompts decoded together"),
    compute: str = typer.Option("bf16", help="the target's compute mode: bf16 | fp32 | fp32+fp16-weights | auto"),
) -> None:
    """Answer ShareGPT prompts with the target's own greedy decoding, as `train-head --data-jsonl` data.

    A head is scored on the target's own continuations; ShareGPT's answers were written by other models.
    Each record keeps its ShareGPT id, so it stays in its conversation's train or held-out split.
    """
    from tqdm import tqdm

    from adaptive_eagle.targets import load_target
    from trainer import data as D
    from trainer.regen import RegenConfig, regenerate, validate

    cfg = RegenConfig(out=out, domains=tuple(d.strip() for d in domains.split(",") if d.strip()),
                      train_conversations=conversations, heldout_conversations=heldout,
                      max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens, batch=batch, compute=compute)
    try:
        validate(cfg)
        tgt = load_target(target, compute=compute, purpose="plain")
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    bar = tqdm(unit="prompt", desc="regen-data")

    def progress(done: int, total: int, tok_s: float) -> None:
        bar.total = total
        bar.n = done
        bar.set_postfix_str(f"{tok_s:.0f} reply tok/s")
        bar.refresh()

    try:
        res = regenerate(cfg, tgt, D.load_sharegpt(), progress)
    except D.DataError as e:  # a bad line in the file being resumed
        fail(f"{e}; fix or move that file, or pass another --out")
    finally:
        bar.close()
    typer.echo(json.dumps(res))
