"""The demo's report: the table (adapted stack next to the frozen head on the same requests), summary.json,
the accept-length plot with promotion and rollback markers, the promotion log's copy, report.md.

Owns: the windows (before drift = the first phase; right after drift = the first third of a later phase;
after adaptation = its last third, by request start time), the figures per window and domain, and
writing the files. Must not touch: the stack, decoding (the figures arrive measured).

Figures. Accept length is tokens per verify step over every step of the window's requests but each
one's last (control.StepCounts). Adapted: what the stack served, from each request's captured trace
(the responses' `adaptive_eagle` field feeds the live view); tokens/s as the mean of the responses'.
Frozen, on the same requests: accept length by acceptance replay of the frozen head on each request's captured record
(exact for greedy traffic); tokens/s from the requests the frozen head decoded again in-process during
the run (every k-th; n given).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from adaptive_eagle_cli.demo.config import Phase
from adaptive_eagle_cli.demo.control import ControlSample, GreedyCheck, StepCounts
from adaptive_eagle_cli.demo.traffic import RequestResult

PLOT = "accept_length.png"
MARKERS = {"promoted": ("tab:green", "-"), "rolled_back": ("tab:red", "-"), "canary_started": ("0.5", ":")}


@dataclass(frozen=True)
class Row:
    window: str  # "before drift" | "right after drift" | "after adaptation"
    domain: str
    requests: int
    heads: str  # head versions that served the window's requests
    accept_length_adapted: Optional[float]
    accept_length_frozen: Optional[float]
    gain_pct: Optional[float]
    tokens_per_s_adapted: Optional[float]
    tokens_per_s_frozen: Optional[float]
    frozen_decoded: int  # requests of the window the frozen head decoded again (its tokens/s)
    # time per output token, median ms: the served arm's requests vs the holdback arm's (the frozen head decoding
    # its share of the same traffic on the same replicas at the same time); gain = frozen / adapted
    tpot_ms_adapted: Optional[float] = None
    tpot_ms_frozen: Optional[float] = None
    holdback_requests: int = 0
    tpot_gain: Optional[float] = None
    tpot_gain_interval: Optional[tuple[float, float]] = None  # 90% bootstrap interval over the two arms' requests


def windows(results: Sequence[RequestResult], phases: Sequence[Phase]) -> list[tuple[str, str, list[RequestResult]]]:
    out = []
    for i, p in enumerate(phases):
        mine = [r for r in results if r.ok and r.phase == i]
        if i == 0:
            out.append(("before drift", p.domain, mine))
            continue
        third = (p.end_s - p.start_s) / 3
        out.append(("right after drift", p.domain, [r for r in mine if r.started_s < p.start_s + third]))
        out.append(("after adaptation", p.domain, [r for r in mine if r.started_s >= p.end_s - third]))
    return out


def _trimmed(steps: Sequence[Sequence[int]]) -> Optional[float]:
    """Tokens per verify step over the requests' steps but each one's last (StepCounts.accept_length)."""
    n = sum(len(a) - 1 for a in steps if len(a) > 1)
    return round(1.0 + sum(sum(a[:-1]) for a in steps if len(a) > 1) / n, 4) if n else None


def table(results: Sequence[RequestResult], phases: Sequence[Phase], counts: dict,
          control: Sequence[ControlSample]) -> list[Row]:
    """counts: request_id -> control.StepCounts (requests without a captured record are left out of both sides)."""
    rows = []
    by_id = {c.request_id: c for c in control}
    for window, domain, rs in windows(results, phases):
        scored = [counts[r.request_id] for r in rs if r.request_id in counts]
        adapted, frozen = _trimmed([c.served for c in scored]), _trimmed([c.frozen for c in scored])
        ctl = [by_id[r.request_id] for r in rs if r.request_id in by_id]
        gain = round(100 * (adapted / frozen - 1), 2) if adapted and frozen else None
        served, held = _tpot_ms(rs, "served"), _tpot_ms(rs, "holdback")
        rows.append(Row(window, domain, len(rs), ",".join(sorted({r.head_version for r in rs})), adapted, frozen, gain,
                        round(float(np.mean([r.tokens_per_s for r in rs])), 2) if rs else None,
                        round(float(np.mean([c.tokens_per_s for c in ctl])), 2) if ctl else None, len(ctl),
                        served, held, sum(r.arm == "holdback" for r in rs),
                        round(held / served, 3) if served and held else None, tpot_gain_interval(rs)))
    return rows


def _tpots(rs: Sequence[RequestResult], arm: str) -> np.ndarray:
    return np.array([r.tpot_s * 1e3 for r in rs if r.arm == arm and r.completion_tokens > 1 and r.tpot_s > 0])


def _tpot_ms(rs: Sequence[RequestResult], arm: str) -> Optional[float]:
    """Median time per output token (ms) of the window's requests of `arm` with more than one output token."""
    xs = _tpots(rs, arm)
    return round(float(np.median(xs)), 2) if len(xs) else None


def tpot_gain_interval(rs: Sequence[RequestResult], level: float = 0.9, resamples: int = 2000,
                       seed: int = 0) -> Optional[tuple[float, float]]:
    """A percentile-bootstrap interval of the TPOT gain (median holdback / median served), each arm's requests
    resampled on their own; None with fewer than 5 requests in an arm. The arms decode different requests (a
    hash share), so with the same head on both the interval holds 1 (and shows how wide the noise is)."""
    served, held = _tpots(rs, "served"), _tpots(rs, "holdback")
    if min(len(served), len(held)) < 5:
        return None
    rng = np.random.default_rng(seed)
    a = np.median(served[rng.integers(0, len(served), (resamples, len(served)))], axis=1)
    b = np.median(held[rng.integers(0, len(held), (resamples, len(held)))], axis=1)
    lo, hi = np.quantile(b / a, [(1 - level) / 2, (1 + level) / 2])
    return round(float(lo), 3), round(float(hi), 3)


def replay_check(results: Sequence[RequestResult], counts: dict, frozen: str) -> dict:
    """How well the replay reproduces serving: the requests the frozen head served itself, scored both ways."""
    own = [counts[r.request_id] for r in results if r.ok and r.head_version == frozen and r.request_id in counts]
    return {"requests": len(own), "served": _trimmed([c.served for c in own]),
            "replayed": _trimmed([c.frozen for c in own]), "requests_differing": sum(c.served[:-1] != c.frozen[:-1]
                                                                                     for c in own)}


def event_seconds(event, t0: float) -> float:
    return datetime.fromisoformat(event.time.replace("Z", "+00:00")).timestamp() - t0


def beats_frozen(own: Sequence) -> Optional[bool]:
    """Whether the served heads' accept length over these requests' step counts (control.StepCounts) beats the
    frozen head's replay of the same requests; None when there are too few to say."""
    served, frozen = _trimmed([c.served for c in own]), _trimmed([c.frozen for c in own])
    return None if served is None or frozen is None else served > frozen


def helped_drifted_domain(results: Sequence[RequestResult], counts: dict, phases: Sequence[Phase], version: str) -> \
        Optional[bool]:
    """Whether `version`, on the drifted domain's requests it served, beat the frozen head replayed on the same
    requests (accept length over their verify steps); None when it served none of them."""
    if len(phases) < 2:
        return None
    drifted = phases[1].domain
    return beats_frozen([counts[r.request_id] for r in results
                         if r.ok and r.head_version == version and r.domain == drifted and r.request_id in counts])


def time_to_adapt(phases: Sequence[Phase], t0: float, candidate_times: Sequence[float], events: Sequence,
                  rows: Sequence[Row], helped: Callable[[str], Optional[bool]] = lambda version: True) -> dict:
    """How fast the loop answered the drift. From the drift's onset (the second phase's start): the first
    candidate the trainer wrote, the first promotion of a head that then served the drifted domain better than
    the frozen head did on the same requests (`helped`; time_to_promotion_s) and the first promotion of any
    head (time_to_any_promotion_s), in seconds, None when none came. recovered_fraction:
    the adapted stack's gain over the frozen head on the drifted domain after adaptation (the same requests),
    divided by the gap between the frozen head on the first domain before the drift and on the drifted domain
    after it: (adapted - frozen) / (frozen before drift - frozen after), None when the drift lowered nothing.
    Both terms of that gap are the frozen head on different domains, which differ in difficulty as well as in
    how well the head knows them: it is the share of the cross-domain gap won back, not of a drop the drift
    alone caused."""
    if len(phases) < 2:
        return {"drift_onset_s": None, "time_to_first_candidate_s": None, "time_to_promotion_s": None,
                "time_to_any_promotion_s": None, "recovered_fraction": None, "accept_length_drop": None}
    onset = phases[1].start_s
    cands = sorted(t - t0 for t in candidate_times if t - t0 >= onset)
    after_onset = sorted((s, e.candidate) for e in events
                         if e.event == "promoted" and (s := event_seconds(e, t0)) >= onset)
    promos = [s for s, version in after_onset if version is not None and helped(version)]
    before = next((r for r in rows if r.window == "before drift"), None)
    after = next((r for r in rows if r.window == "after adaptation"), None)
    recovered = drop = None
    if before and after and None not in (before.accept_length_frozen, after.accept_length_frozen,
                                         after.accept_length_adapted):
        drop = before.accept_length_frozen - after.accept_length_frozen
        if drop > 0:
            recovered = round((after.accept_length_adapted - after.accept_length_frozen) / drop, 3)
    return {"drift_onset_s": round(onset, 1),
            "time_to_first_candidate_s": round(cands[0] - onset, 1) if cands else None,
            "time_to_promotion_s": round(promos[0] - onset, 1) if promos else None,
            "time_to_any_promotion_s": round(after_onset[0][0] - onset, 1) if after_onset else None,
            "recovered_fraction": recovered, "accept_length_drop": None if drop is None else round(drop, 4)}


def latency_line(trainer_status: Optional[dict]) -> str:
    """The trainer's last candidate: how long after capture its records reached it, and where the time went."""
    from trainer.nearline import describe_latency

    latency = (trainer_status or {}).get("candidate_latency")
    return describe_latency(latency) if latency else "no candidate in the trainer's current process"


def adapt_line(s: dict) -> str:
    """One line on the time to adapt, for the report and the plot."""
    def minutes(x) -> str:
        return "none" if x is None else f"{x / 60:.1f} min"

    frac, drop = s.get("recovered_fraction"), s.get("accept_length_drop")
    if frac is None:
        won = "recovered – of the accept-length drop"
    elif frac > 1:  # a small drop (the frozen head was as weak before the drift): a share of it says little
        won = f"won back all of the accept-length drop ({drop:.3f}) and more: the gain is {frac:.1f}x the drop"
    else:
        won = f"recovered {100 * frac:.0f}% of the accept-length drop ({drop:.3f})"
    return (f"after the drift: first candidate {minutes(s.get('time_to_first_candidate_s'))}, promotion "
            f"{minutes(s.get('time_to_promotion_s'))}; {won}")


def tool_calls(results: Sequence[RequestResult]) -> Optional[dict]:
    """The agent turns' calls, per tool_choice: answered turns, turns with calls, and turns whose every call names
    a tool of the turn's set with arguments valid under its schema ("required": exactly one such call). None
    without agent turns."""
    from adaptive_eagle_cli.demo.agent import call_valid

    out: dict = {}
    for r in results:
        choice = r.prompt.tool_choice
        if not r.ok or not r.prompt.tools or choice is None:
            continue
        c = out.setdefault(choice, {"turns": 0, "with_calls": 0, "valid": 0, "invalid_examples": []})
        c["turns"] += 1
        c["with_calls"] += bool(r.tool_calls)
        valid = bool(r.tool_calls) and all(call_valid(r.domain, name, args) for _, name, args in r.tool_calls)
        valid &= choice != "required" or len(r.tool_calls) == 1
        c["valid"] += valid
        if not valid and choice == "required" and len(c["invalid_examples"]) < 5:
            c["invalid_examples"].append(f"{r.request_id}: {r.text[:160]!r}")
    return out or None


def summary(rows: Sequence[Row], results: Sequence[RequestResult], events: Sequence, checks: Sequence[GreedyCheck],
            control: Sequence[ControlSample], extra: dict) -> dict:
    drift = next((r for r in rows if r.window == "after adaptation"), rows[0] if rows else None)
    kinds = [e.event for e in events]
    return {
        "drift_domain": drift.domain if drift else None,
        "drift_window": drift.window if drift else None,
        "drift_accept_length_adapted": drift.accept_length_adapted if drift else None,
        "drift_accept_length_frozen": drift.accept_length_frozen if drift else None,
        "drift_gain_pct": drift.gain_pct if drift else None,
        "drift_tpot_ms_adapted": drift.tpot_ms_adapted if drift else None,
        "drift_tpot_ms_frozen": drift.tpot_ms_frozen if drift else None,
        "drift_tpot_gain": drift.tpot_gain if drift else None,
        "drift_tpot_gain_interval": drift.tpot_gain_interval if drift else None,
        "holdback_requests": sum(r.ok and r.arm == "holdback" for r in results),
        "requests": len(results),
        "failed_requests": sum(not r.ok for r in results),
        "failures": [f"{r.request_id or r.index}: {r.error}" for r in results if not r.ok][:20],
        "promotions": kinds.count("promoted"),
        "rollbacks": kinds.count("rolled_back"),
        "candidates_considered": kinds.count("considered"),
        "canaries": kinds.count("canary_started"),
        "greedy_checks": {"checked": len(checks), "mismatches": sum(not c.equal for c in checks),
                          "requests": [asdict(c) for c in checks]},
        "control": {"frozen_decoded": len(control), "frozen_text_differs": sum(not c.same_text for c in control)},
        "table": [asdict(r) for r in rows],
        "tool_calls": tool_calls(results),
        **extra,
    }


def plot(path: Path, results: Sequence[RequestResult], counts: dict, phases: Sequence[Phase], events: Sequence,
         t0: float, title: str, note: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    domains = list(dict.fromkeys(p.domain for p in phases))
    labelled = set()
    for i, phase in enumerate(phases):  # one segment a phase (a returning domain is not joined across the gap)
        pts = sorted((r.finished_s / 60, StepCounts.accept_length(counts[r.request_id].served),
                      StepCounts.accept_length(counts[r.request_id].frozen))
                     for r in results if r.ok and r.phase == i and r.domain == phase.domain and r.request_id in counts)
        pts = [p for p in pts if p[1] is not None and p[2] is not None]
        if not pts:
            continue
        domain = phase.domain
        c = colors[domains.index(domain) % len(colors)]
        first = domain not in labelled
        labelled.add(domain)
        x = [p[0] for p in pts]
        ax.scatter(x, [p[1] for p in pts], s=10, color=c, alpha=0.3)
        ax.plot(x, _rolling([p[1] for p in pts]), color=c, lw=2, label=f"{domain}: adapted (served)" if first else None)
        ax.plot(x, _rolling([p[2] for p in pts]), color=c, lw=1.5, ls="--",
                label=f"{domain}: frozen head (replay, same requests)" if first else None)
    for p in phases[1:]:
        ax.axvline(p.start_s / 60, color="k", lw=0.8, ls="-.")
    for p in phases:
        ax.text((p.start_s + p.end_s) / 120, 1.0, p.domain, transform=ax.get_xaxis_transform(), ha="center", va="bottom")
    seen = set()
    for e in events:
        if e.event in MARKERS:
            color, ls = MARKERS[e.event]
            label = None if e.event in seen else e.event.replace("_", " ")
            seen.add(e.event)
            ax.axvline(event_seconds(e, t0) / 60, color=color, ls=ls, lw=1.8, label=label)
    ax.set_xlabel("minutes of traffic")
    ax.set_ylabel("accept length (tokens per verify step)")
    ax.set_title(title + (f"\n{note}" if note else ""), pad=18)
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rolling(xs: Sequence[float], n: int = 8) -> np.ndarray:
    """Mean of the last `n` values at each point."""
    a = np.asarray(xs, dtype=float)
    return np.array([a[max(0, i - n + 1):i + 1].mean() for i in range(len(a))])


def _fmt(x, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown(s: dict, rows: Sequence[Row], events: Sequence, info: dict) -> str:
    rc = s.get("replay_check") or {}
    lines = ["# adaptive-eagle demo report", "",
             f"{info['when']} · {info['duration_s']:.0f} s · target {info['target']} · frozen head {info['frozen_head']}"
             f" · scenario {' → '.join(info['scenario'])} · {info['clients']} clients · {info['max_tokens']} tokens a "
             f"request · {info['machine']}", "",
             "## Result", "",
             f"- drifted domain **{s['drift_domain']}**, {s['drift_window']}: accept length adapted "
             f"**{_fmt(s['drift_accept_length_adapted'])}** vs frozen shipped head **{_fmt(s['drift_accept_length_frozen'])}**"
             f" on the same requests ({_fmt(s['drift_gain_pct'], 2)}%)",
             f"- requests {s['requests']}, failed **{s['failed_requests']}**; sampled responses equal to plain greedy "
             f"decoding: {s['greedy_checks']['checked'] - s['greedy_checks']['mismatches']}/{s['greedy_checks']['checked']}",
             f"- gate decisions: {s['candidates_considered']} candidates considered, {s['canaries']} canaries, "
             f"{s['promotions']} promotions, {s['rollbacks']} rollbacks",
             f"- time to adapt: {adapt_line(s)}",
             f"- trainer latency, last candidate: {latency_line(s.get('trainer'))}",
             *_tool_lines(s.get("tool_calls")), "",
             "| window | domain | requests | heads served | accept length adapted | frozen | gain % | TPOT ms adapted "
             "| TPOT ms frozen, holdback (n) | TPOT gain [90% interval] |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.window} | {r.domain} | {r.requests} | {r.heads} | {_fmt(r.accept_length_adapted)} | "
                     f"{_fmt(r.accept_length_frozen)} | {_fmt(r.gain_pct, 2)} | {_fmt(r.tpot_ms_adapted, 1)} | "
                     f"{_fmt(r.tpot_ms_frozen, 1)} ({r.holdback_requests}) | {_fmt(r.tpot_gain, 3)} "
                     f"{_interval(r.tpot_gain_interval)} |")
    lines += _phase_lines(s.get("phase_figures") or [])
    lines += ["", f"![accept length over time]({PLOT})", "", "## Gate decisions (promotions.jsonl)", ""]
    lines += [f"- `{e.time[11:19]}` **{e.event}** {e.candidate or ''}: {e.reason}" for e in events] or ["- none"]
    lines += ["", "## How the figures are measured", "",
              "- Accept length = tokens committed per verify step (bonus included) over every verify step of the "
              "window's requests but each request's last (the engine's last step may accept past max_tokens, which "
              "a replay cannot see). Adapted: as served, from each request's captured trace (the live view shows the "
              "responses' `adaptive_eagle` field); tokens/s = mean over the window's responses.",
              "- Frozen: the shipped head never updated, on the same requests. Accept length by acceptance replay "
              "(trainer/replay.py) of the frozen head on each request's captured record: exact for greedy traffic "
              "with these engine settings (no prompt lookup, no suffix drafts, no cost-aware pruning).",
              f"- Time per output token (TPOT, after the first token; median ms): adapted = the window's requests the "
              f"replicas decoded with the served heads; frozen = the holdback arm, the {s.get('holdback_requests', 0)} "
              "requests (a fixed share, by a hash of the request id) the same replicas decoded with the frozen "
              "shipped head at the same time, under the same load. TPOT gain = frozen / adapted (above 1: adapting "
              "made decoding faster), with a 90% percentile-bootstrap interval (each arm's requests resampled): an "
              "interval that holds 1 shows no effect this window could tell from noise (the arms decode different "
              "requests). The same comparison runs live in production: ae_loop_tpot_gain in /metrics.",
              "- Time to adapt: from the drift's onset (the second phase's start) to the first candidate the trainer "
              "wrote and to the first promotion. Recovered fraction = (adapted - frozen) / (frozen before drift - "
              "frozen after adaptation), accept length on the same requests: the share of the drift's drop won back.",
              "- Windows: before drift = the first phase; right after drift = the first third of the next phase; after "
              "adaptation = its last third (by request start).",
              f"- Replay check: on the {rc.get('requests', 0)} requests the frozen head served itself, served "
              f"{_fmt(rc.get('served'))} vs replayed {_fmt(rc.get('replayed'))} ({rc.get('requests_differing', 0)} "
              "requests differ in some step: float rounding at near ties).",
              f"- The frozen head's greedy text differed from the served text on {s['control']['frozen_text_differs']} "
              "of the requests it decoded again (lossless decoding: 0 expected).",
              "", "## Configuration", "", "```json", json.dumps(info["config"], indent=1), "```"]
    if s["failures"]:
        lines += ["", "## Failed requests", ""] + [f"- {f}" for f in s["failures"]]
    return "\n".join(lines) + "\n"


def _phase_lines(figs: Sequence[dict]) -> list[str]:
    """The per-phase table (adaptive_eagle_cli/demo/phases.py), for runs through more than one drift."""
    if len(figs) < 3:
        return []
    out = ["", "## Phases", "", "Every phase on its own requests: served heads vs the frozen shipped head (accept "
           "length, same requests; TPOT, holdback arm), time from the phase's start to the first promotion that "
           "helped it, and on a returning domain the share of its best gain lost by its return (forgetting; "
           "adaptive_eagle_cli/demo/phases.py). 90% intervals over requests.", "",
           "| phase | domain | returning | requests | accept served | frozen | gain % [90%] | TPOT gain [90%] | "
           "promotions | to promotion s [90%] | forgetting % [90%] |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in figs:
        out.append(f"| {f['phase']} | {f['domain']} | {'yes' if f['returning'] else 'no'} | {f['requests']} | "
                   f"{_fmt(f['accept_length_served'])} | {_fmt(f['accept_length_frozen'])} | {_fmt(f['gain_pct'], 2)} "
                   f"{_pct_interval(f['gain_pct_interval'])} | {_fmt(f['tpot_gain'], 3)} "
                   f"{_interval(f['tpot_gain_interval'])} | {f['promotions']} | {_fmt(f['time_to_promotion_s'], 0)} "
                   f"{_seconds_interval(f.get('time_to_promotion_s_interval'))} | "
                   f"{_fmt(f['forgetting_pct'], 2)} {_pct_interval(f['forgetting_pct_interval'])} |")
    return out


def _seconds_interval(iv) -> str:
    """[lo, hi] in whole seconds; an open end (no decision in over 5% of resamples) reads '–'."""
    return f"[{_fmt(iv[0], 0)}, {_fmt(iv[1], 0)}]" if iv else ""


def _pct_interval(iv) -> str:
    return f"[{iv[0]:.1f}, {iv[1]:.1f}]" if iv else ""


def _interval(iv) -> str:
    return f"[{iv[0]:.3f}, {iv[1]:.3f}]" if iv else "[too few requests]"


def _tool_lines(calls: Optional[dict]) -> list[str]:
    if not calls:
        return []
    out = []
    for choice, c in sorted(calls.items()):
        out.append(f"- agent turns with tool_choice {choice}: {c['turns']}, answered with calls {c['with_calls']}, "
                   f"every call valid (a tool of the turn's set, arguments valid under its schema"
                   f"{'; exactly one call' if choice == 'required' else ''}) **{c['valid']}**")
    return out


def write(out: Path, s: dict, rows: Sequence[Row], events: Sequence, info: dict, log_path: Path, plot_args: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(s, indent=1, default=str) + "\n")
    if log_path.is_file():
        shutil.copyfile(log_path, out / "promotions.jsonl")
    else:
        (out / "promotions.jsonl").write_text("")
    plot(out / PLOT, **plot_args)
    (out / "report.md").write_text(markdown(s, rows, events, info))


__all__ = ["PLOT", "Row", "adapt_line", "latency_line", "event_seconds", "markdown", "plot", "replay_check", "summary", "table",
           "time_to_adapt", "windows", "write"]
