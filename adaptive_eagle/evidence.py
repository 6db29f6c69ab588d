"""A candidate's test-then-train evidence: the trainer replays every record it reads with the champion and
with each candidate snapshot that has not trained on it, before training on it, and appends the pair here.
The policy re-reads the file as it grows and judges it with the sequential offline gate.

Owns: the evidence's format (one JSON file per candidate, `<registry>/evidence/<version>.json`, rewritten
atomically so a reader never sees half a file), its validation, reading and writing. Must not touch: the
gates (policies/), training (trainer/).

A row is one record: [request_id, domain, champion's accept length, candidate's accept length, greedy,
context] (context: the record's context position, adaptive_eagle.positions.context_position, which the
policy's context-length guard slices by; rows of files written before it have five elements). Rows
are in arrival order (the order the trainer read the records), which the sequential gate relies on. `open`
is true while the trainer still adds rows; it closes the file with a reason (the evidence cap, a newer
snapshot, the champion changed, the trainer restarted from it), after which the gate decides on what is there.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from adaptive_eagle.atomic import atomic_write_text

EVIDENCE_DIR = "evidence"
EVIDENCE_FORMAT = 1

# request_id, domain, champion, candidate, greedy[, context position]
Row = tuple[str, Optional[str], float, float, bool] | tuple[str, Optional[str], float, float, bool, Optional[int]]


class EvidenceError(ValueError):
    """An evidence file was refused; the message names the file and the reason."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


class CandidateEvidence(BaseModel):
    """Test-then-train evidence of one candidate against one champion."""

    model_config = ConfigDict(extra="forbid")

    format_version: Literal[1] = EVIDENCE_FORMAT
    version: str = Field(min_length=1)
    champion: str = Field(min_length=1, description="the head the candidate is judged against ('none': plain)")
    mode: Literal["prequential"] = "prequential"
    recipe: dict = Field(default_factory=dict, description="the replay tree and what the snapshot trained on")
    open: bool = True
    closed_reason: Optional[str] = None
    updated_at: float = 0.0
    rows: list[Row] = Field(default_factory=list)

    @field_validator("rows")
    @classmethod
    def _rows(cls, rows: list[Row]) -> list[Row]:
        ids = set()
        for r in rows:
            if not r[0]:
                raise ValueError("a row without a request id")
            if r[0] in ids:
                raise ValueError(f"request {r[0]} appears twice")
            if not (r[2] >= 1.0 and r[3] >= 1.0):
                raise ValueError(f"request {r[0]}: accept lengths must be >= 1, got {r[2]} and {r[3]}")
            ids.add(r[0])
        return rows

    @property
    def greedy(self) -> int:
        return sum(1 for r in self.rows if r[4])

    @property
    def exact(self) -> bool:
        """Every record greedy: the replay is what each head would have served."""
        return bool(self.rows) and self.greedy == len(self.rows)

    def add(self, request_id: str, domain: Optional[str], champion: float, candidate: float, greedy: bool,
            context: Optional[int] = None) -> None:
        self.rows.append((request_id, domain, round(float(champion), 4), round(float(candidate), 4), bool(greedy),
                          None if context is None else int(context)))

    def close(self, reason: str) -> None:
        self.open, self.closed_reason = False, reason


def evidence_path(registry_root: str | os.PathLike, version: str) -> Path:
    return Path(registry_root) / EVIDENCE_DIR / f"{version}.json"


def write_evidence(registry_root: str | os.PathLike, evidence: CandidateEvidence) -> Path:
    """Write (replace) the file atomically; the directory is made on first use."""
    path = evidence_path(registry_root, evidence.version)
    path.parent.mkdir(parents=True, exist_ok=True)
    evidence.updated_at = time.time()
    atomic_write_text(path, evidence.model_dump_json(), fsync=False)
    return path


def read_evidence(registry_root: str | os.PathLike, version: str) -> Optional[CandidateEvidence]:
    """The candidate's evidence; None when it has none (yet). A malformed file is refused (EvidenceError), never
    read as empty."""
    path = evidence_path(registry_root, version)
    if not path.is_file():
        return None
    try:
        ev = CandidateEvidence.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EvidenceError(path, f"malformed JSON ({e})") from None
    except ValidationError as e:
        raise EvidenceError(path, "; ".join(f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}"
                                            for err in e.errors())) from None
    if ev.version != version:
        raise EvidenceError(path, f"names version {ev.version!r}, not {version!r}")
    return ev


__all__ = ["EVIDENCE_DIR", "CandidateEvidence", "EvidenceError", "Row", "evidence_path", "read_evidence",
           "write_evidence"]
