"""The policy's commands, mounted at the top level of ``adaptive-eagle``: ``promotions`` (read the log),
``rollback``, ``pin VERSION``, ``unpin`` (on-call; each also writes a promotion-log line).

Owns: parsing options and printing. Must not touch: decisions (``policies.controller`` does the work),
the registry's files (``adaptive_eagle.registry`` does), torch (the registry is imported inside commands).

The promotion log lives at ``<registry>/promotions.jsonl`` unless ``--log`` says otherwise. Read-only
commands never create anything: a mistyped path is an error saying what to pass. The on-call commands
move the registry's champion pointer; the running policy brings the fleet to it on its next tick.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from policies.log import LOG_NAME, PromotionLog

policies_app = typer.Typer(help="The promotion policy: its log, rollback, pin and unpin.", add_completion=False,
                           no_args_is_help=True)
REGISTRY = typer.Option(..., "--registry", "-r", help="head registry root (a local or shared directory)")
LOG = typer.Option(None, "--log", help=f"promotion log (default: <registry>/{LOG_NAME}, else ./{LOG_NAME})")


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _log_path(log: Optional[Path], registry: Optional[Path]) -> Path:
    if log is not None:
        return log
    return (registry if registry is not None else Path(".")) / LOG_NAME


def _writable_log(log: Optional[Path], registry: Path) -> PromotionLog:
    """The log an on-call command appends to; its directory must exist before anything is changed."""
    path = _log_path(log, registry)
    if not path.parent.is_dir():
        _fail(f"{path.parent}: directory of the promotion log does not exist (check --log)")
    return PromotionLog(path)


def _registry(root: Path):
    from adaptive_eagle.registry import HeadRegistry, RegistryError

    try:
        return HeadRegistry(root)
    except RegistryError as e:
        _fail(f"{e} (check --registry)")


def _on_call(fn):
    """Run an on-call operation; a refusal (RegistryError is a ValueError) becomes `error: ...`, exit 2."""
    try:
        return fn()
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))


@policies_app.command("promotions")
def promotions(log: Optional[Path] = LOG,
               registry: Optional[Path] = typer.Option(None, "--registry", "-r", help="registry whose log to read"),
               follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines as they come"),
               as_json: bool = typer.Option(False, "--json", help="one JSON object per line, as stored"),
               last: Optional[int] = typer.Option(None, "--last", "-n", min=1, help="only the last N events")) -> None:
    """Every promotion decision, oldest first: time, event, versions, the tail (champion -> candidate with
    the confidence interval of the gain), mean, sample counts and the one-sentence reason."""
    path = _log_path(log, registry)
    plog = PromotionLog(path)
    if not path.is_file():
        _fail(f"{path}: no promotion log there; pass --log PATH or --registry R (the policy writes "
              f"<registry>/{LOG_NAME})")
    read = plog.read()
    events = read.events[-last:] if last else read.events
    if as_json:
        for e in events:
            typer.echo(e.line())
    else:
        from rich.console import Console

        from policies.render import event_table

        Console().print(event_table(events, title=f"{path} ({len(read.events)} events)"))
    if read.skipped:
        typer.secho(f"warning: skipped {read.skipped} corrupt line(s): {', '.join(map(str, read.skipped_lines[:20]))}",
                    fg=typer.colors.YELLOW, err=True)
    if follow:
        _follow(plog, as_json)


def _follow(plog: PromotionLog, as_json: bool) -> None:
    from policies.render import mean_cell, n_cell, tail_cell, versions_cell

    try:
        for e in plog.follow(from_start=False):
            if as_json:
                typer.echo(e.line())
            else:
                ev = e.evidence or {}
                cells = [e.time.replace("T", " ")[:19], e.event, e.by, versions_cell(e), tail_cell(ev), mean_cell(ev),
                         n_cell(ev), e.reason]
                typer.echo("  ".join(c for c in cells if c))
    except KeyboardInterrupt:
        pass


@policies_app.command("rollback")
def rollback(registry: Path = REGISTRY, reason: str = typer.Option("", help="why (kept in the log and the block)"),
             log: Optional[Path] = LOG) -> None:
    """Move the champion back to the previous one and block the current one (the policy swaps the fleet)."""
    from policies.controller import rollback_champion

    reg = _registry(registry)
    plog = _writable_log(log, registry)
    before = _on_call(reg.champion)
    _on_call(lambda: rollback_champion(reg, plog, reason or "rolled back by on-call", by="on-call"))
    typer.echo(f"champion {before} -> {reg.champion()}; {before} blocked (adaptive-eagle heads unblock lifts it)")


@policies_app.command("pin")
def pin(version: str = typer.Argument(..., help="the version to serve ('none': plain decoding)"),
        registry: Path = REGISTRY, reason: str = typer.Option("", help="why (kept in the log)"),
        log: Optional[Path] = LOG) -> None:
    """Serve VERSION and promote nothing else until unpinned (makes it the champion if it is not)."""
    from policies.controller import pin_version

    reg = _registry(registry)
    plog = _writable_log(log, registry)
    decision = _on_call(lambda: pin_version(reg, plog, version, reason))
    typer.echo(decision.reason)


@policies_app.command("unpin")
def unpin(registry: Path = REGISTRY, log: Optional[Path] = LOG) -> None:
    """Let the policy promote again."""
    from policies.controller import unpin_version

    reg = _registry(registry)
    plog = _writable_log(log, registry)
    decision = _on_call(lambda: unpin_version(reg, plog))
    typer.echo(decision.reason)


__all__ = ["policies_app"]
