"""Decoding speed, batch 1, greedy, against an honest baseline: the fastest PLAIN decoding this
machine can run.

Plain rows: this engine with no head, and HF `generate()`, each in every compute mode available here
(CPU: bf16, fp32, fp32+fp16-weights where FBGEMM and a bf16 checkpoint allow it; CUDA: bf16, fp16,
fp32). Every speedup divides by the fastest of them, named in each table and the JSON ("baseline":
"hf-generate[fp32+fp16-weights]"). Speculative rows run in the default mode (`load_target`'s
measured choice, exact by default; `--compute` forces one): HF `generate()` + prompt lookup, and
this engine as chain, tree, tree + lookup (the default: + the cross-request suffix index where the
engine has it) and the default with a fixed tree size.

Workloads: English (held-out ShareGPT first turns), repetitive (rewrite a given code block: the
answer quotes its input) and agent (`bench/workloads.agent_prompts`: structured output over varying
real inputs, served in sequence so later requests can reuse earlier outputs through the engine's
suffix index; rows there: the plain baselines, HF prompt lookup and the engine's default) and sessions
(long multi-turn agent sessions, `bench/sessions.py`: held-out chat and tool sessions replayed turn by
turn with plain greedy decoding, so every request carries the whole history and the target's own
earlier answers; the requests benchmarked are spread over the sessions' context lengths, up to the
target's context; rows as for agent) and json (structured outputs: held-out questions under two strict JSON
schemas and JSON mode, `bench/workloads.json_prompts`; every row constrained by the same grammar, the engine's
through adaptive_eagle/grammar.py and HF generate() through xgrammar's own HF logits processor; the engine's
mask time per output token is reported). Each
engine row owns its engine (its own suffix index) and engines are built afresh per workload;
calibration persistence is off, so rows do not feed each other and runs repeat. Every request prefills
cold, as HF's rows do: an engine row's prefix cache is emptied before each request, so time to first token
compares cold prefills; what the prefix cache saves on a session's later turn is measured apart ("sessions
prefill").

Mismatches: every row's output is compared token for token with plain greedy output of this engine
in the SAME compute mode; rows in an inexact mode (bf16, fp16) are also compared with the plain
output of the exact mode (both reported). Methods run interleaved prompt by prompt, so machine
noise hits them alike. Ends with one JSON line (speedup_vs_plain, baseline, mismatches,
agent_speedup_vs_plain, agent_speedup_vs_prompt_lookup, sessions_speedup_vs_plain,
sessions_speedup_vs_prompt_lookup, head_install_ms, compute, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adaptive_eagle.checkpoint import load_head  # noqa: E402
from adaptive_eagle.compute import available_modes, is_exact_mode, mode_of  # noqa: E402
from adaptive_eagle.cpu_linear import fbgemm_fp16_available, raw_rows  # noqa: E402
from adaptive_eagle.engine import EngineConfig, SpeculativeEngine  # noqa: E402
from adaptive_eagle.targets import checkpoint_dtype, load_target  # noqa: E402
from adaptive_eagle.trace import SamplingParams  # noqa: E402
from trainer import data as D  # noqa: E402

SHIPPED = Path(__file__).resolve().parent.parent / "heads" / "smollm2-135m-english-v2"
DEFAULT_ROW = "tree+lookup"  # the engine's default configuration
WORKLOADS = ("english", "repetitive", "agent", "sessions", "json")
SESSION_CHARS = 16000  # characters of context a session grows to (about 4k tokens): bench/sessions.py


def english_prompts(conversations, n: int, max_chars: int = 1200) -> list[str]:
    return D.first_user_messages(conversations, n, domains=["english"], split="heldout", max_chars=max_chars)


def code_rewrite_prompts(conversations, n: int) -> list[str]:
    convs = D.select(conversations, domains=["code"], split="heldout")
    out = []
    for c in convs:
        for m in c.messages:
            block = re.search(r"```[a-zA-Z]*\n(.{200,900}?)```", m.content, re.S) if m.role == "assistant" else None
            if block:
                out.append("Here is some code:\n```\n" + block.group(1) + "```\nRepeat this code exactly, adding a "
                           "one-line comment at the top that says what it does.")
                break
        if len(out) == n:
            break
    return out


def engine_config(**kw) -> EngineConfig:
    """EngineConfig with the options this engine version has (suffix_drafting, calibration_dir are newer)."""
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in kw.items() if k in known})


def hf_generate(target, ids, max_new, lookup: int | None, grammar=None) -> tuple[list[int], float]:
    """HF generate() as a user runs it: the kernels at the row counts it calls them with (raw_rows), not padded
    to the row counts exactness needs (cpu_linear.py), so the baseline is not slowed by our exactness. grammar
    (adaptive_eagle.grammar.Grammar): constrained by xgrammar's own logits processor for HF, as a user would."""
    x = torch.tensor([ids], device=target.device)
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    if grammar is not None:
        from xgrammar.contrib.hf import LogitsProcessor

        kw["logits_processor"] = [LogitsProcessor(grammar.compiled)]
    clock = _FirstToken()
    with raw_rows():
        out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                                    pad_token_id=target.tokenizer.eos_token_id, streamer=clock, **kw)
    return out[0, len(ids):].tolist(), clock.first if clock.first is not None else time.perf_counter() - clock.t0


@dataclass
class Row:
    """One method in one compute mode; run(ids, max_new, response_format or None) -> (tokens, accept length or
    None, seconds to the first token, seconds spent on the grammar's masks)."""

    name: str
    mode: str
    run: Callable[[list[int], int, dict | None], tuple[list[int], float | None, float, float]]
    plain: bool = False  # a non-speculative row: a baseline candidate
    speculative: bool = False  # an engine row with drafting (counted in the headline mismatches)
    tokens: int = 0
    seconds: float = 0.0
    accept: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)  # per request: seconds to the first token (the prefill)
    tpot: list[float] = field(default_factory=list)  # per request: seconds per output token after the first
    mask_s: float = 0.0  # the grammar's mask and pruning time (constrained engine rows)
    mismatch_same: int = 0
    mismatch_exact: int | None = None


def _engine_run(engine: SpeculativeEngine):
    def run(ids, max_new, fmt=None):
        grammar = engine.grammar(fmt) if fmt is not None else None  # compiled once per format (cached)
        engine.prefix_cache.clear()  # a cold prefill, as HF's; the prefix cache is measured apart
        t0, first, res = time.perf_counter(), None, None
        for toks, res in engine.stream(ids, SamplingParams(max_tokens=max_new), grammar=grammar):
            if toks and first is None:
                first = time.perf_counter() - t0
        return (res.token_ids, res.accept_length_mean, first if first is not None else time.perf_counter() - t0,
                res.constraint_s)

    return run


def _hf_run(target, lookup: int | None, grammars: SpeculativeEngine):
    """HF generate() rows; `grammars`: an engine on the same tokenizer whose compiled formats they reuse."""
    def run(ids, max_new, fmt=None):
        toks, first = hf_generate(target, ids, max_new, lookup, grammars.grammar(fmt) if fmt is not None else None)
        return toks, None, first, 0.0

    return run


class _FirstToken:
    """A generate() streamer that notes when the first new token arrives (its first put() is the prompt)."""

    def __init__(self) -> None:
        self.t0, self.puts, self.first = time.perf_counter(), 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter() - self.t0

    def end(self) -> None:
        pass


def build_rows(workload: str, targets: dict, default_mode: str, head, version: str | None, tree: dict) -> list[Row]:
    """Fresh engines for one workload: plain engine + HF generate() per mode, then the speculative rows."""
    quiet = dict(calibration_dir="")  # no persisted calibration: rows independent, runs repeatable
    plains = {m: SpeculativeEngine(t, None, engine_config(prompt_lookup=False, suffix_drafting=False, **quiet))
              for m, t in targets.items()}
    rows = [Row(f"plain[{m}]", m, _engine_run(e), plain=True) for m, e in plains.items()]
    rows += [Row(f"hf-generate[{m}]", m, _hf_run(t, None, plains[m]), plain=True) for m, t in targets.items()]
    target = targets[default_mode]
    if workload != "json":  # xgrammar's HF processor keeps one matcher per sequence: HF's assisted decoding breaks it
        rows.append(Row("hf-prompt-lookup", default_mode, _hf_run(target, 10, plains[default_mode])))

    def spec(name, **kw):
        engine = SpeculativeEngine(target, head, engine_config(**{**tree, **quiet, **kw}), head_version=version)
        return Row(name, default_mode, _engine_run(engine), speculative=True)

    if workload not in ("agent", "sessions", "json"):
        rows.append(spec("chain", topk=1, num_draft_tokens=tree["depth"], prompt_lookup=False, suffix_drafting=False))
        rows.append(spec("tree", prompt_lookup=False, suffix_drafting=False))
    rows.append(spec(DEFAULT_ROW))
    if workload not in ("agent", "sessions", "json"):
        rows.append(spec(f"{DEFAULT_ROW}-fixed", cost_aware=False))
    return rows


def _pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank), 0.0 when empty."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _differs(toks: list[int], ref: list[int]) -> bool:
    """Any difference is a mismatch: other tokens, or fewer or more of them (an output that stops early, or is
    only a prefix of plain greedy decoding's, is not the same output)."""
    return toks != ref


def run_set(name: str, prompts: list, rows: list[Row], encode, exact_mode: str, max_new: int) -> dict:
    """Run every row on every prompt (prompt-major, in order), then tabulate against the fastest plain row."""
    lengths = []
    for i, prompt in enumerate(prompts):
        prompt, fmt = prompt if isinstance(prompt, tuple) else (prompt, None)  # json: (messages, response_format)
        ids = encode(prompt)
        lengths.append(len(ids))
        outputs: dict[str, list[int]] = {}
        for row in rows:
            t0 = time.perf_counter()
            toks, accept, ttft, mask_s = row.run(ids, max_new, fmt)
            wall = time.perf_counter() - t0
            row.seconds += wall
            row.mask_s += mask_s
            row.tokens += len(toks)
            row.ttft.append(ttft)
            if len(toks) > 1:
                row.tpot.append((wall - ttft) / (len(toks) - 1))
            outputs[row.name] = toks
            if accept is not None:
                row.accept.append(accept)
        for row in rows:  # the plain engine output of each mode is that mode's reference
            row.mismatch_same += _differs(outputs[row.name], outputs[f"plain[{row.mode}]"])
            if not is_exact_mode(row.mode):
                row.mismatch_exact = (row.mismatch_exact or 0) + _differs(outputs[row.name], outputs[f"plain[{exact_mode}]"])
        print(f"  [{name}] prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    tps = {r.name: r.tokens / r.seconds if r.seconds else 0.0 for r in rows}
    baseline = max((r for r in rows if r.plain), key=lambda r: tps[r.name]).name
    # the fastest plain decoding by each phase: the lowest median time per output token, and to the first token
    plain_rows = [r for r in rows if r.plain]
    tpot_base = min(plain_rows, key=lambda r: statistics.median(r.tpot) if r.tpot else math.inf)
    ttft_base = min(plain_rows, key=lambda r: statistics.median(r.ttft))
    table = {}
    for r in rows:
        tpot50 = statistics.median(r.tpot) if r.tpot else math.nan
        table[r.name] = {"mode": r.mode, "tokens_per_s": round(tps[r.name], 2),
                         "speedup_vs_plain": round(tps[r.name] / max(1e-9, tps[baseline]), 3),
                         "ttft_p50_s": round(statistics.median(r.ttft), 4), "ttft_p95_s": round(_pct(r.ttft, 0.95), 4),
                         "tpot_p50_ms": round(tpot50 * 1e3, 2), "tpot_p95_ms": round(_pct(r.tpot, 0.95) * 1e3, 2),
                         "tpot_speedup_vs_plain": round(statistics.median(tpot_base.tpot) / tpot50, 3)
                         if r.tpot and tpot_base.tpot else None,
                         "ttft_ratio_vs_plain": round(statistics.median(r.ttft) / statistics.median(ttft_base.ttft), 3),
                         "accept_length_mean": round(statistics.mean(r.accept), 3) if r.accept else 1.0,
                         "mask_ms_per_token": round(1e3 * r.mask_s / r.tokens, 3) if r.mask_s and r.tokens else None,
                         "mismatches": r.mismatch_same, "mismatches_vs_exact": r.mismatch_exact}
    print(f"\n{name}: {len(prompts)} prompts, {max_new} new tokens each; baseline = {baseline} "
          f"(the fastest plain decoding end to end; {tpot_base.name} per output token, {ttft_base.name} to the "
          f"first); mismatches vs plain greedy in the same mode / in {exact_mode}")
    print(f"{'method':32s} {'tok/s':>7s} {'x base':>7s} {'TTFT50':>7s} {'TTFT95':>7s} {'TPOT50':>7s} {'TPOT95':>7s} "
          f"{'x TPOT':>7s} {'accept':>7s} {'mism':>5s} {'vs exact':>8s}")
    for n, r in table.items():
        vs_exact = "-" if r["mismatches_vs_exact"] is None else str(r["mismatches_vs_exact"])
        print(f"{n:32s} {r['tokens_per_s']:7.2f} {r['speedup_vs_plain']:7.2f} {r['ttft_p50_s']:7.3f} "
              f"{r['ttft_p95_s']:7.3f} {r['tpot_p50_ms']:7.1f} {r['tpot_p95_ms']:7.1f} "
              f"{r['tpot_speedup_vs_plain'] or 0:7.2f} {r['accept_length_mean']:7.2f} {r['mismatches']:5d} "
              f"{vs_exact:>8s}")
    context = {"min": min(lengths), "median": int(statistics.median(lengths)), "max": max(lengths)}
    print(f"prompt tokens: min {context['min']}, median {context['median']}, max {context['max']}")
    return {"baseline": baseline, "tpot_baseline": tpot_base.name, "ttft_baseline": ttft_base.name,
            "prompts": len(prompts), "context_tokens": context, "rows": table}


def head_install(target, loaded, tree: dict) -> tuple[float, str]:
    """(ms, how): engine.set_head(loaded head) on a running plain engine; without set_head, the time
    to construct an engine with the head (includes the engine's cost calibration)."""
    engine = SpeculativeEngine(target, None, engine_config(**tree, calibration_dir=""))
    set_head = getattr(engine, "set_head", None)
    if set_head is not None:
        t0 = time.perf_counter()
        res = set_head(loaded)
        wall = (time.perf_counter() - t0) * 1e3
        if not getattr(res, "ok", True):
            return float("nan"), f"set_head refused: {getattr(res, 'message', res)}"
        return round(getattr(res, "install_ms", wall), 2), "engine.set_head(LoadedHead)"
    t0 = time.perf_counter()
    SpeculativeEngine(target, loaded.head.to(target.dtype), engine_config(**tree), head_version=loaded.meta.version)
    return round((time.perf_counter() - t0) * 1e3, 2), "engine construction with the head (no set_head here)"


def session_prompts(conversations, n: int, max_new: int, plain: SpeculativeEngine,
                    turns_out: list | None = None) -> list[list[dict]]:
    """`n` requests of long held-out sessions (bench/sessions.py), spread evenly over every turn sent: the
    sessions are replayed turn by turn with `plain` greedy decoding (the answers every exact row gives too),
    each request carrying the whole history, up to the target's context less `max_new` tokens."""
    from bench.sessions import build_sessions, replay

    context = plain.target.config.max_position_embeddings - max_new - 1
    sessions = build_sessions(D.select(conversations, split="heldout"), max(2, (n + 4) // 5),
                              min_chars=SESSION_CHARS, answer_chars=4 * max_new)
    sent: list[list[dict]] = []
    for sess in sessions:
        def generate(messages, k):
            return plain.generate(messages, SamplingParams(max_tokens=max_new)).text

        sent += replay(sess, generate, fits=lambda m: len(plain.encode(m)) <= context)
    if turns_out is not None:  # every turn sent, in order: prefix_cache_prefill finds each pick's previous turn
        turns_out.extend(sent)
    picks = [round(i * (len(sent) - 1) / max(1, n - 1)) for i in range(min(n, len(sent)))]
    return [sent[i] for i in sorted(set(picks))]


def prefix_cache_prefill(target, turns: list, picks: list, encode, models: dict) -> dict:
    """A session's later turn, prefilled cold (empty prefix cache) and warm (its previous turn prefilled first,
    as a serving engine would have), next to HF's one-forward prefill of it in the fastest of `models` (mode ->
    model; raw kernels, the last row's logits only): medians over every picked request that has a previous turn
    in its session."""
    from transformers import DynamicCache

    engine = SpeculativeEngine(target, None, engine_config(prompt_lookup=False, suffix_drafting=False,
                                                           calibration_dir=""))
    pc = engine.prefix_cache
    cold, warm, reused = [], [], []
    hf: dict[str, list[float]] = {m: [] for m in models}

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for cur in picks:
        i = next(k for k, t in enumerate(turns) if t is cur)
        prev = turns[i - 1] if i > 0 and cur[: len(turns[i - 1])] == turns[i - 1] else None
        if prev is None:
            continue
        ids, before = encode(cur), encode(prev)
        pc.clear()
        cold.append(timed(lambda: engine._prefill_blocks(ids, DynamicCache(), True, False)))
        pc.clear()
        engine._prefill_blocks(before, DynamicCache(), True, False)
        hits = pc.counts.hit_tokens
        warm.append(timed(lambda: engine._prefill_blocks(ids, DynamicCache(), True, False)))
        reused.append((pc.counts.hit_tokens - hits) / len(ids))
        with raw_rows():
            x = torch.tensor([ids], device=target.device)
            for m, model in models.items():
                hf[m].append(timed(lambda: model(input_ids=x, use_cache=True, logits_to_keep=1)))
    if not cold:
        return {"requests": 0}
    med = statistics.median
    fastest = min(hf, key=lambda m: med(hf[m]))
    return {"requests": len(cold), "cold_p50_s": round(med(cold), 3), "warm_p50_s": round(med(warm), 3),
            "hf_prefill_p50_s": round(med(hf[fastest]), 3), "hf_prefill_mode": fastest,
            "warm_vs_cold": round(med(warm) / med(cold), 3), "cold_vs_hf": round(med(cold) / med(hf[fastest]), 3),
            "reused_fraction_p50": round(med(reused), 3)}


def load_prompts(workload: str, conversations, n: int, max_new: int = 128,
                 plain: SpeculativeEngine | None = None, turns_out: list | None = None) -> list | None:
    if workload == "sessions":
        return session_prompts(conversations, n, max_new, plain, turns_out)
    if workload == "english":
        return english_prompts(conversations, n)
    if workload == "repetitive":
        return code_rewrite_prompts(conversations, n)
    if workload == "json":
        from bench.workloads import json_prompts

        return json_prompts(D.select(conversations, domains=["english"], split="heldout"), n)
    try:
        from bench.workloads import agent_prompts
    except ImportError as e:
        print(f"agent workload skipped: bench/workloads.py has no agent_prompts yet ({e})", file=sys.stderr)
        return None
    return list(agent_prompts(D.select(conversations, domains=["english"], split="heldout"), n))


def _tpot_ratio(table: dict | None, row: str, over: str) -> float | None:
    """How many times faster `row` decodes than `over` per output token (medians)."""
    if table is None:
        return None
    rows = table["rows"]
    return round(rows[over]["tpot_p50_ms"] / max(1e-9, rows[row]["tpot_p50_ms"]), 3)


def _ratio(table: dict | None, row: str, over: str) -> float | None:
    if table is None:
        return None
    rows = table["rows"]
    return round(rows[row]["tokens_per_s"] / max(1e-9, rows[over]["tokens_per_s"]), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, default=SHIPPED)
    ap.add_argument("--quick", action="store_true", help="2 prompts per workload, 48 new tokens")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--workload", choices=[*WORKLOADS, "all"], action="append",
                    help="repeatable; default: all five")
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--num-draft-tokens", type=int, default=16)
    ap.add_argument("--compute", default="auto", help="mode of the speculative rows (default: measured, exact)")
    ap.add_argument("--device", default="auto", help="auto: CUDA when present")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_new = min(args.prompts, 2), min(args.max_new, 48)
    chosen = args.workload or ["all"]
    workloads = WORKLOADS if "all" in chosen else tuple(w for w in WORKLOADS if w in chosen)
    torch.manual_seed(0)
    target = load_target(device=args.device, compute=args.compute, prefill="auto")
    default_mode = mode_of(target.compute)
    modes = available_modes(target.device.type, checkpoint_dtype(target.path), fbgemm_fp16_available())
    targets = {m: target if m == default_mode else load_target(device=target.device, compute=m) for m in modes}
    targets.setdefault(default_mode, target)
    exact_mode = default_mode if is_exact_mode(default_mode) else next(m for m in modes if is_exact_mode(m))
    print(f"target compute: {target.compute} ({target.lossless}); {target.compute_choice.reason}; "
          f"{getattr(target, 'prefill_choice', '') or 'prompts prefill in the same mode'}", file=sys.stderr)
    loaded = load_head(args.head, target, device=target.device)
    head = loaded if hasattr(SpeculativeEngine, "set_head") else loaded.head.to(target.dtype)
    tree = dict(depth=args.depth, topk=args.topk, num_draft_tokens=args.num_draft_tokens)
    install_ms, install_how = head_install(target, loaded, tree)
    conversations = list(D.load_sharegpt())  # parsed once for every workload
    encoder = SpeculativeEngine(target, None, engine_config(prompt_lookup=False, suffix_drafting=False,
                                                            cost_aware=False, calibration_dir=""))
    results, prefill = {}, None
    with torch.inference_mode():
        for w in workloads:
            turns: list = []
            prompts = load_prompts(w, conversations, args.prompts, args.max_new, encoder, turns)
            if not prompts:
                results[w] = None
                continue
            rows = build_rows(w, targets, default_mode, head, loaded.meta.version, tree)
            results[w] = run_set(w, prompts, rows, encoder.encode, exact_mode, args.max_new)
            if w == "sessions":
                prefill = prefix_cache_prefill(target, turns, prompts, encoder.encode,
                                               {m: t.model for m, t in targets.items()})
                print(f"sessions prefill (prefix cache): {json.dumps(prefill)}")
    eng, rep, agent, sessions, js = (results.get(w) for w in WORKLOADS)
    spec = [r for t in results.values() if t for n, r in t["rows"].items()
            if n in ("chain", "tree", DEFAULT_ROW, f"{DEFAULT_ROW}-fixed")]
    figures = {
        "speedup_vs_plain": eng and eng["rows"][DEFAULT_ROW]["speedup_vs_plain"],
        "baseline": eng and eng["baseline"],
        "mismatches": sum(r["mismatches"] for r in spec),
        "speedup_vs_prompt_lookup": _ratio(eng, DEFAULT_ROW, "hf-prompt-lookup"),
        "accept_length_mean": eng and eng["rows"][DEFAULT_ROW]["accept_length_mean"],
        "repetitive_speedup_vs_plain": rep and rep["rows"][DEFAULT_ROW]["speedup_vs_plain"],
        "repetitive_speedup_vs_prompt_lookup": _ratio(rep, DEFAULT_ROW, "hf-prompt-lookup"),
        "agent_speedup_vs_plain": agent and agent["rows"][DEFAULT_ROW]["speedup_vs_plain"],
        "agent_speedup_vs_prompt_lookup": _ratio(agent, DEFAULT_ROW, "hf-prompt-lookup"),
        "sessions_speedup_vs_plain": sessions and sessions["rows"][DEFAULT_ROW]["speedup_vs_plain"],
        "sessions_speedup_vs_prompt_lookup": _ratio(sessions, DEFAULT_ROW, "hf-prompt-lookup"),
        "sessions_context_tokens": sessions and sessions.get("context_tokens"),
        "tpot_speedup_vs_plain": eng and eng["rows"][DEFAULT_ROW]["tpot_speedup_vs_plain"],
        "repetitive_tpot_speedup_vs_plain": rep and rep["rows"][DEFAULT_ROW]["tpot_speedup_vs_plain"],
        "agent_tpot_speedup_vs_plain": agent and agent["rows"][DEFAULT_ROW]["tpot_speedup_vs_plain"],
        "sessions_tpot_speedup_vs_plain": sessions and sessions["rows"][DEFAULT_ROW]["tpot_speedup_vs_plain"],
        "sessions_tpot_speedup_vs_prompt_lookup": _tpot_ratio(sessions, DEFAULT_ROW, "hf-prompt-lookup"),
        "sessions_ttft_ratio_vs_plain": sessions and sessions["rows"][DEFAULT_ROW]["ttft_ratio_vs_plain"],
        "sessions_prefill": prefill,
        "json_tpot_speedup_vs_plain": js and js["rows"][DEFAULT_ROW]["tpot_speedup_vs_plain"],
        "json_speedup_vs_plain": js and js["rows"][DEFAULT_ROW]["speedup_vs_plain"],
        "json_accept_length": js and js["rows"][DEFAULT_ROW]["accept_length_mean"],
        "json_mask_ms_per_token": js and js["rows"][DEFAULT_ROW]["mask_ms_per_token"],
        "head_install_ms": install_ms, "head_install_measures": install_how,
        "compute": target.compute, "lossless": target.lossless, "compute_choice": target.compute_choice.reason,
        "prefill": getattr(target, "prefill_choice", "") or target.compute,
        "forward_ms": target.compute_choice.table and {
            m: {q: round(ms, 2) for q, ms in r.items()} for m, r in target.compute_choice.table.forward_ms.items()},
        "modes": list(targets), "head": loaded.meta.version, "quick": args.quick,
        "prompts": args.prompts, "max_new": args.max_new, **{w: results.get(w) for w in WORKLOADS},
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
