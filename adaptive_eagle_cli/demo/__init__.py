"""`adaptive-eagle demo`: the main job — the whole loop adapting to drifting traffic on one machine.

Starts the local stack (loop.stack.LocalStack: the real SmolLM2-135M target, the shipped English head
as the first champion, a local feature store, one replica, the near-line trainer, the promotion policy,
the OpenAI-compatible gateway), sends real ShareGPT prompts whose mix drifts (English chat → code by
default) through the `openai` client, shows a live view, and writes a report that sets the adapted stack
next to the frozen shipped head on the same requests. It composes serving, trainer and policies, so it
lives here, above all of them.

Modules: config (options, phase plan, the demo's stack config), traffic (prompts and clients), control
(frozen head and plain greedy decoding in-process), view (live view), report (table, summary.json, plot,
report.md), run (the steps in order). Owns: the command line only. Must not touch: the packages below.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Optional

import typer

demo_app = typer.Typer(add_completion=False)

QUICK = {"minutes": 3.5, "max_tokens": 32, "think_s": 0.5, "control_every": 3, "greedy_checks": 3,
         "max_prompt_chars": 300}


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@demo_app.command("demo")
def demo(
    minutes: Optional[float] = typer.Option(None, help="wall-clock budget, start-up and report included "
                                            "(default 15; --quick 3.5)"),
    out: Path = typer.Option(Path("demo-report"), help="report directory (report.md, summary.json, plot, log)"),
    scenario: Optional[str] = typer.Option(None, help="domains the traffic drifts through, in order, 1 to 12 "
                                           "phases, a domain may come back (english, code, math, agent, sessions, "
                                           "tools, tools2), or `long` (= english,sessions: short chat drifting to "
                                           "long multi-turn agent sessions), or `agent` (= tools,tools2: an agent "
                                           "loop calling tools whose tool set changes halfway; the default)"),
    first_phase_share: Optional[float] = typer.Option(None, help="share of the traffic time of the first phase, in "
                                                     "(0, 1) (default 0.2; the agent scenario 0.5); the other phases "
                                                     "split the rest evenly"),
    head: str = typer.Option("dense", help="the head kind the trainer adapts: dense, or moe (it grows an expert for "
                             "a domain whose acceptance stays low)"),
    prompts: Optional[Path] = typer.Option(None, help="your own prompts instead of ShareGPT: JSONL of "
                                           "{\"prompt\": ...} or {\"messages\": [...]}, optional \"domain\""),
    clients: int = typer.Option(2, help="concurrent openai clients"),
    quick: bool = typer.Option(False, "--quick", help="a few-minute run: short answers, fast candidates (CI)"),
    max_tokens: Optional[int] = typer.Option(None, help="tokens per request (default 96; --quick 32)"),
    think: Optional[float] = typer.Option(None, help="seconds a client pauses between requests (default 1; --quick 0.5)"),
    control_every: Optional[int] = typer.Option(None, help="decode every k-th request again in-process with the "
                                                "frozen head: its text must equal the served one (default 6; --quick 3)"),
    greedy_checks: Optional[int] = typer.Option(None, help="responses checked against plain greedy decoding "
                                                "(default 5; --quick 3)"),
    holdback: float = typer.Option(0.15, help="share of requests the replicas decode with the frozen shipped head "
                                   "next to the adapted one (the report's time per output token, same load)"),
    port: int = typer.Option(0, help="gateway port (0: any free port)"),
    state_dir: Optional[Path] = typer.Option(None, help="stack state (registry, store, trainer); default: a "
                                             "temporary directory removed afterwards"),
    keep_state: bool = typer.Option(False, help="keep the temporary state directory"),
    seed: int = typer.Option(0, help="seed of the prompt order"),
    evidence: str = typer.Option("prequential", help="how candidates are judged: prequential (test-then-train: "
                                 "every record replayed, then trained on) or heldout (a share never trained on)"),
) -> None:
    """The main job: the whole loop on drifting traffic — serving, capture, near-line training, gated
    promotion — next to the frozen shipped head on the same requests. Writes report.md, summary.json,
    accept_length.png and promotions.jsonl to --out. Exits non-zero when a request failed, a sampled
    response differs from plain greedy decoding or from the frozen head's greedy decoding, or a replay is
    inexact."""
    from adaptive_eagle.cli import SHIPPED_HEAD, fail
    from adaptive_eagle_cli.demo.config import DemoConfig, DemoConfigError
    from adaptive_eagle_cli.demo.run import run_demo

    given = {"minutes": minutes, "max_tokens": max_tokens, "think_s": think, "control_every": control_every,
             "greedy_checks": greedy_checks, "first_phase_share": first_phase_share}
    defaults = QUICK if quick else {}
    fields = {k: v if v is not None else defaults.get(k) for k, v in given.items()}
    if quick:
        fields["max_prompt_chars"] = QUICK["max_prompt_chars"]
    try:
        cfg = DemoConfig.make(**fields, out=str(out), scenario=scenario, prompts=str(prompts) if prompts else None,
                              clients=clients, quick=quick, port=port, state_dir=str(state_dir) if state_dir else None,
                              keep_state=keep_state, seed=seed, evidence=evidence, holdback=holdback,
                              head=head)
    except DemoConfigError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None
    if not (SHIPPED_HEAD / "head.json").exists():
        fail(f"no shipped head at {SHIPPED_HEAD}; train one with `adaptive-eagle train-head`")
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops it like Ctrl-C: report on what ran, stack stopped
    outcome = run_demo(cfg, echo=typer.echo)
    s = outcome.summary
    typer.secho(f"\nreport: {outcome.out / 'report.md'}", bold=True)
    typer.echo(f"{s['drift_domain']} ({s['drift_window']}): accept length adapted {s['drift_accept_length_adapted']} "
               f"vs frozen {s['drift_accept_length_frozen']} ({s['drift_gain_pct']}%); time per output token "
               f"{s.get('drift_tpot_ms_adapted')} vs frozen {s.get('drift_tpot_ms_frozen')} ms (holdback arm, gain "
               f"{s.get('drift_tpot_gain')}, 90% interval {s.get('drift_tpot_gain_interval')}); promotions {s['promotions']}, "
               f"failed requests {s['failed_requests']}, greedy mismatches {s['greedy_checks']['mismatches']}")
    from adaptive_eagle_cli.demo.run import failed_checks
    for what in failed_checks(s):
        typer.secho(f"check failed: {what} (see the report's log)", fg="red", err=True)
    raise typer.Exit(outcome.exit_code)


__all__ = ["demo_app"]
