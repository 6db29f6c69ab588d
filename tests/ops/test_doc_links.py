"""Every in-repo anchor link resolves: `[text](#anchor)` and `[text](path.md#anchor)` in ops/RUNBOOK.md,
docs/*.md and README.md, and each alert's `runbook:` annotation in ops/alerts.yml, must name a heading of the
file it points at by the slug GitHub gives that heading (lower case; punctuation other than `-` and `_`
dropped; each space a `-`; a repeated slug gets -1, -2, ...). A heading that joins two alerts
("QueueDepthHigh / RequestsRejected429") has one slug for both, which a link to either name misses."""

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
LINK = re.compile(r"\[(?:[^\]]|\n)*?\]\(([^()\s]+)\)")


def github_slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def slugs(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def anchor_links(path: Path) -> list[tuple[str, Path, str]]:
    """(link as written, the file it points at, its anchor) of every in-repo link with an anchor."""
    out = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or "#" not in target:
            continue  # http:, mailto:, ... or no anchor
        file, anchor = target.split("#", 1)
        out.append((target, (path.parent / file).resolve() if file else path, anchor))
    return out


def test_the_slug_rule_matches_githubs():
    assert github_slug("QueueDepthHigh / RequestsRejected429") == "queuedepthhigh--requestsrejected429"
    assert github_slug("CaptureDrops / CaptureStalled — the store is down or slow") == (
        "capturedrops--capturestalled--the-store-is-down-or-slow")
    assert github_slug("SGLang replicas (SGLang 0.5.23)") == "sglang-replicas-sglang-0523"
    assert github_slug("The OpenAI-compatible gateway and `adaptive-eagle up`") == (
        "the-openai-compatible-gateway-and-adaptive-eagle-up")
    found = anchor_links(REPO / "README.md")  # a link whose text spans lines is found too
    assert ("#glossary", REPO / "README.md", "glossary") in found and len(found) >= 3


def documents() -> list[Path]:
    return [REPO / "ops" / "RUNBOOK.md", REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_anchor_link_names_a_heading(doc):
    broken = []
    for link, target, anchor in anchor_links(doc):
        if not target.is_file():
            broken.append(f"{link}: no file {target}")
        elif target.suffix == ".md" and anchor not in slugs(target):
            broken.append(f"{link}: no heading with slug {anchor!r} in {target.relative_to(REPO)}")
    assert not broken, broken


def test_every_alert_links_its_own_runbook_heading():
    runbook = slugs(REPO / "ops" / "RUNBOOK.md")
    rules = [r for g in yaml.safe_load((REPO / "ops" / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    assert rules
    broken = [(r["alert"], r["annotations"]["runbook"]) for r in rules
              if not r["annotations"]["runbook"].startswith("ops/RUNBOOK.md#")
              or r["annotations"]["runbook"].split("#", 1)[1] not in runbook]
    assert not broken, broken
