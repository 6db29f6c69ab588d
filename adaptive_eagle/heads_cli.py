"""`adaptive-eagle heads ...`: the head registry from the command line (list, show, init, add,
champion, pin, unpin, block, unblock, break-lock). Thin: parses options, calls registry.py, prints.
Read-only commands never create anything: a mistyped --registry is an error, not an empty registry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from adaptive_eagle.cli import fail

heads_app = typer.Typer(help="The head registry: versions, lineage, champion pointer, pins and blocks.",
                        add_completion=False, no_args_is_help=True)
REGISTRY = typer.Option(..., "--registry", "-r", help="registry root (a local or shared directory)")


def _open(root: Path):
    from adaptive_eagle.registry import HeadRegistry, RegistryError

    try:
        return HeadRegistry(root)
    except RegistryError as e:
        fail(str(e))


def _run(fn):
    """Call fn(); a registry refusal becomes a clear error and exit code 1."""
    from adaptive_eagle.checkpoint import HeadValidationError
    from adaptive_eagle.registry import RegistryError

    try:
        return fn()
    except (RegistryError, HeadValidationError, ValueError) as e:
        fail(str(e))


def _accept(metrics: dict) -> str:
    ev = (metrics.get("heldout_eval") or {}).get("english") or metrics.get("heldout_english") or {}
    value = ev.get("accept_length") if isinstance(ev, dict) else None
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


@heads_app.command("list")
def list_versions(registry: Path = REGISTRY, as_json: bool = typer.Option(False, "--json")) -> None:
    """Every version, oldest first, with parent, creation time, held-out English accept length and
    marks: * champion, P pinned, B blocked."""
    reg = _open(registry)
    versions = _run(reg.versions)
    champion = pinned = None
    blocked: dict = {}
    if (registry / "champion.json").exists():
        champion, pin, blocked = _run(reg.champion), _run(reg.pinned), _run(reg.blocked)
        pinned = pin.version if pin else None
    if as_json:
        typer.echo(json.dumps({"champion": champion, "pinned": pinned, "blocked": sorted(blocked),
                               "versions": [{"version": v.version, "parent": v.parent, "created": v.created,
                                             "window": v.window, "accept_length": _accept(v.metrics)}
                                            for v in versions]}, default=str))
        return
    typer.echo(f"champion: {champion or '(no champion pointer: heads init)'}"
               + (f"   pinned: {pinned}" if pinned else ""))
    typer.echo(f"{'':3s}{'version':36s} {'parent':32s} {'created':20s} {'accept(en)':>10s}")
    for v in versions:
        mark = ("*" if v.version == champion else " ") + ("P" if v.version == pinned else " ") + \
            ("B" if v.version in blocked else " ")
        typer.echo(f"{mark}{v.version:36s} {str(v.parent or '-'):32s} {v.created[:19]:20s} {_accept(v.metrics):>10s}")


@heads_app.command("show")
def show(version: str = typer.Argument(...), registry: Path = REGISTRY) -> None:
    """One version's head.json figures and its lineage inside the registry."""
    reg = _open(registry)
    v = _run(lambda: reg.version(version))
    typer.echo(json.dumps({"version": v.version, "path": str(v.path), "parent": v.parent,
                           "lineage": _run(lambda: reg.lineage(version)), "created": v.created,
                           "target": v.target_name, "target_fingerprint": v.target_fingerprint, "sha256": v.sha256,
                           "data": v.data, "training": v.training, "metrics": v.metrics}, indent=2, default=str))


@heads_app.command("init")
def init(registry: Path = REGISTRY) -> None:
    """Make a registry (champion 'none' = plain decoding); safe to rerun, keeps what is there."""
    from adaptive_eagle.registry import HeadRegistry

    reg = _run(lambda: HeadRegistry.create(registry))
    typer.echo(f"registry {reg.root}: champion {reg.champion()}")


@heads_app.command("add")
def add(src: Path = typer.Argument(..., help="a head version directory to import"), registry: Path = REGISTRY) -> None:
    """Import a head version (validated, checksum included); versions are immutable."""
    reg = _open(registry)
    typer.echo(_run(lambda: reg.add(src)))


@heads_app.command("champion")
def champion(registry: Path = REGISTRY, set_to: Optional[str] = typer.Option(None, "--set", help="new champion"),
             expect: Optional[str] = typer.Option(None, help="the champion you expect now (compare-and-set)"),
             reason: str = typer.Option("", help="why, for the promotion log")) -> None:
    """Print the champion pointer, or move it with --set and --expect (refused when the champion
    changed meanwhile, the version is blocked, or another version is pinned)."""
    reg = _open(registry)
    if set_to is None:
        c = _run(reg.champion_pointer)
        typer.echo(json.dumps({"champion": c.version, "previous": c.previous, "set_at": c.set_at, "reason": c.reason,
                               "generation": c.generation}))
        return
    if expect is None:
        fail("--set needs --expect CURRENT (the champion you saw), so two writers cannot both win")
    change = _run(lambda: reg.set_champion(set_to, expect=expect, reason=reason))
    if not change.ok:
        fail(change.message)
    typer.echo(change.message)


@heads_app.command("pin")
def pin(version: str = typer.Argument(...), registry: Path = REGISTRY, reason: str = typer.Option("")) -> None:
    """Pin a version (or 'none'): only it may become champion until unpinned."""
    reg = _open(registry)
    p = _run(lambda: reg.pin(version, reason))
    typer.echo(f"pinned {p.version}")


@heads_app.command("unpin")
def unpin(registry: Path = REGISTRY) -> None:
    reg = _open(registry)
    p = _run(reg.unpin)
    typer.echo(f"unpinned {p.version}" if p else "nothing was pinned")


@heads_app.command("block")
def block(version: str = typer.Argument(...), registry: Path = REGISTRY,
          reason: str = typer.Option(..., help="why (required)")) -> None:
    """Block a version: it can never become champion until unblocked."""
    reg = _open(registry)
    b = _run(lambda: reg.block(version, reason))
    typer.echo(f"blocked {b.version}: {b.reason}")


@heads_app.command("unblock")
def unblock(version: str = typer.Argument(...), registry: Path = REGISTRY) -> None:
    reg = _open(registry)
    b = _run(lambda: reg.unblock(version))
    typer.echo(f"unblocked {b.version}" if b else f"{version} was not blocked")


@heads_app.command("break-lock")
def break_lock(registry: Path = REGISTRY) -> None:
    """Remove a lock left by a writer that died (check that no writer is running first)."""
    reg = _open(registry)
    held = _run(reg.break_lock)
    typer.echo(f"removed the lock held by {held}" if held else "no lock was held")
