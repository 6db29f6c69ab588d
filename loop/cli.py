"""The loop's commands (a Typer sub-app mounted by adaptive_eagle_cli): `adaptive-eagle up`.

Owns: reading the stack config, printing where everything is, and waiting for Ctrl-C / SIGTERM to
stop the stack cleanly. Must not touch: starting the parts (stack.py).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Optional

import typer

loop_app = typer.Typer(add_completion=False)


@loop_app.command("up")
def up(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="stack config (YAML); see --print-config"),
    port: Optional[int] = typer.Option(None, help="gateway port (overrides serving.port; 0: any free port)"),
    print_config: bool = typer.Option(False, "--print-config", help="print the default config as YAML and exit"),
    check: bool = typer.Option(False, "--check", help="check the config (each section, and whether every stage of "
                               "the loop can work with them together), print what is wrong, start nothing; exit 0 "
                               "when it can run, 2 when not"),
) -> None:
    """Start the whole loop: Ray, the feature store, server replicas, near-line training, the promotion
    policy and the OpenAI-compatible gateway. Ctrl-C (or SIGTERM) stops all of it."""
    from loop.config import StackConfigError, defaults_yaml, load_stack_config

    if print_config:
        typer.echo(defaults_yaml(), nl=False)
        return
    try:
        cfg = load_stack_config(config)
        if port is not None:
            if not 0 <= port <= 65535:
                raise StackConfigError(f"--port: must be in [0, 65535], got {port}")
            cfg = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"port": port})})
    except StackConfigError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None
    if check:
        check_config(cfg, str(config) if config else "the defaults")
        return
    run_until_signal(cfg)


def check_config(cfg, source: str) -> None:
    """`up --check`: every problem on a line of its own (the fields involved, what to change), then notes."""
    from loop.check import check_stack

    result = check_stack(cfg)
    for line in result.lines():
        typer.echo(line, err=not result.ok)
    if not result.ok:
        typer.secho(f"{source}: {len(result.problems)} problem(s); the stack would not start", fg="red", err=True)
        raise typer.Exit(2)
    typer.secho(f"{source}: ok, every stage of the loop can run", fg="green")


def run_until_signal(cfg) -> None:
    from loop.stack import LocalStack

    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    stack = LocalStack(cfg, echo=typer.echo)
    try:
        typer.secho("adaptive-eagle up: starting (loading the target can take a minute) ...", bold=True)
        info = stack.start()
        for line in info.lines():
            typer.echo("  " + line)
        typer.secho("serving; Ctrl-C stops everything.", bold=True)
        stop.wait()
        typer.echo("stopping ...")
    finally:
        stack.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    typer.echo("stopped.")
