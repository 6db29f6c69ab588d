"""The head-version label of plain decoding (no draft head), one home for every package.

The engine, its traces and the stored records carry `None` when no head was bound. Everything that names
versions as strings spells it PLAIN: the head registry's champion pointer, serving's replicas and responses,
the promotion policy's samples, the feature store's record filter and metric labels. `version_label` and
`engine_version` convert at the edges. A registry never admits a version called PLAIN.

Torch-free: the policy and the store import it.
"""

from __future__ import annotations

PLAIN = "none"


def version_label(version: str | None) -> str:
    """The string label of an engine's or a record's head version (None: plain decoding)."""
    return PLAIN if version is None else version


def engine_version(label: str) -> str | None:
    """The engine's head version for a string label (PLAIN: None)."""
    return None if label == PLAIN else label


__all__ = ["PLAIN", "engine_version", "version_label"]
