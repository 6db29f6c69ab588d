"""A candidate's replay evidence, both kinds: what the trainer measured, in the forms the policy reads back.

Owns two formats and their validation:
- held-out and test-then-train evidence as a candidate's head.json records it (`metrics.replay`,
  `ReplayEvidence`): the evidence kind, the champion it was judged against, the replay tree, and for held-out
  evidence the summaries and per-record samples of both heads. The trainer writes it through the model
  (`to_metrics`), the loop reads it through the model (`from_head_meta` / `from_metrics`), which refuses a
  malformed block with a reason naming the field.
- the test-then-train evidence file (`CandidateEvidence`): the trainer replays every record it reads with the
  champion and with each candidate snapshot that has not trained on it, before training on it, and appends the
  pair here. The policy re-reads the file as it grows and judges it with the sequential offline gate. One JSON
  file per candidate, `<registry>/evidence/<version>.json`, rewritten atomically so a reader never sees half a
  file.
Must not touch: the gates (policies/), training (trainer/), torch (the loop and the policy's side read it).

A held-out sample is one record replayed by one head: [request_id, domain, accept_length, context] (context:
the record's context position, adaptive_eagle.positions.context_position; rows written before it have three
elements and read as context None).

A test-then-train row is one record: [request_id, domain, champion's accept length, candidate's accept length,
greedy, context] (context as above; rows of files written before it have five elements). Rows are in arrival
order (the order the trainer read the records), which the sequential gate relies on. `open` is true while the
trainer still adds rows; it closes the file with a reason (the evidence cap, a newer snapshot, the champion
changed, the trainer restarted from it), after which the gate decides on what is there.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from adaptive_eagle.atomic import atomic_write_text
from adaptive_eagle.versions import PLAIN

EVIDENCE_DIR = "evidence"
EVIDENCE_FORMAT = 1

# request_id, domain, champion, candidate, greedy[, context position]
Row = tuple[str, Optional[str], float, float, bool] | tuple[str, Optional[str], float, float, bool, Optional[int]]


class EvidenceError(ValueError):
    """An evidence file was refused; the message names the file and the reason."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


def _reason(e: ValidationError, prefix: str = "") -> str:
    """A pydantic refusal as `field.path: message; ...`, each path under `prefix` (a whole-object refusal: the
    prefix itself, or 'value')."""
    def where(loc: tuple) -> str:
        return prefix + ".".join(map(str, loc)) if loc else prefix.rstrip(".") or "value"

    return "; ".join(f"{where(err['loc'])}: {err['msg']}" for err in e.errors())


# ---- head.json metrics.replay ---------------------------------------------------------------------------
EvidenceKind = Literal["heldout", "prequential"]
HELDOUT: EvidenceKind = "heldout"
PREQUENTIAL: EvidenceKind = "prequential"
SAMPLE_ROW = "[request_id, domain, accept_length] or [request_id, domain, accept_length, context_position]"


class ReplayTree(BaseModel):
    """The draft-tree parameters both heads were replayed with (the serving tree: trainer.replay.TreeParams)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    depth: int = Field(ge=1, description="draft steps per tree")
    topk: int = Field(ge=1, description="children expanded per node")
    num_draft_tokens: int = Field(ge=1, description="tree nodes verified per step")
    min_path_prob: float = Field(ge=0.0, lt=1.0, description="paths below this draft probability are pruned")


class DomainSummary(BaseModel):
    """One head's replay on one domain's records."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    records: int = Field(ge=0, description="records replayed")
    accept_length: float = Field(ge=1.0, description="tokens per verify step over all steps, bonus included")
    p5_accept_length: float = Field(ge=1.0, description="5th percentile of the per-record accept lengths")


class ReplaySummary(BaseModel):
    """One head's replay on the held-out records (trainer.replay.ReplayScore.summary)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    records: int = Field(ge=0, description="records replayed")
    steps: int = Field(ge=0, description="verify steps replayed")
    accept_length: float = Field(ge=1.0, description="tokens per verify step over all steps, bonus included")
    p5_accept_length: float = Field(ge=1.0, description="5th percentile of the per-record accept lengths")
    alpha: list[Annotated[float, Field(ge=0.0, le=1.0)]] = Field(
        description="j-α, j = 0, 1, ...: P(a step accepts >= j + 1 draft tokens | it accepted >= j)")
    domains: Optional[dict[str, DomainSummary]] = Field(
        default=None, description="per domain ('untagged': no domain); absent when every record is untagged")


class ReplaySample(BaseModel):
    """One record replayed by one head; written as the row [request_id, domain, accept_length(, context)]."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    request_id: str = Field(min_length=1, description="pairs the two heads' samples of one record")
    domain: Optional[str] = Field(description="the record's domain tag, if any")
    accept_length: float = Field(ge=1.0, description="tokens per verify step of this record, bonus included")
    context: Optional[int] = Field(default=None, ge=0, description="the record's context position "
                                   "(adaptive_eagle.positions); None: written before it was recorded")

    @model_validator(mode="before")
    @classmethod
    def _from_row(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            if len(value) not in (3, 4):
                raise ValueError(f"a sample row is {SAMPLE_ROW}, got {list(value)!r}")
            return dict(zip(("request_id", "domain", "accept_length", "context"), value))
        return value

    @model_serializer(mode="plain")
    def _to_row(self) -> list:
        return [self.request_id, self.domain, self.accept_length] + ([] if self.context is None else [self.context])


class ReplaySamples(BaseModel):
    """Per-record samples of both heads on the same held-out records, which the offline gate pairs by request."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    candidate: list[ReplaySample] = Field(default_factory=list, description="the candidate's samples")
    champion: list[ReplaySample] = Field(default_factory=list, description="the champion's (plain decoding: 1.0)")


class ReplayEvidence(BaseModel):
    """A candidate's replay evidence as its head.json records it (`metrics.replay`).

    Held-out: candidate and champion replayed on the same held-out records when the candidate was written;
    the samples are complete. Test-then-train (prequential): written without samples; they grow in the
    candidate's evidence file (CandidateEvidence). Fields absent from files written before they existed read
    as their defaults; `to_metrics` writes exactly the fields the writer set.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    evidence: EvidenceKind = Field(default=HELDOUT, description="the kind; files without it are held-out")
    champion_version: str = Field(default=PLAIN, min_length=1,
                                  description=f"the champion the candidate was judged against ({PLAIN!r}: plain)")
    tree: Optional[ReplayTree] = Field(default=None, description="the replay tree")
    records: int = Field(default=0, ge=0, description="held-out records replayed (test-then-train: 0)")
    skipped: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict,
                                                            description="records left out, by reason")
    candidate: Optional[ReplaySummary] = Field(default=None, description="the candidate's replay summary")
    champion: Optional[ReplaySummary] = Field(default=None, description="the champion's; None for plain decoding")
    greedy_records: Optional[int] = Field(default=None, ge=0, description="replayed records that were greedy "
                                          "(None: written before it was counted)")
    exact: bool = Field(default=False, description="every replayed record was greedy: the replay is what each "
                        "head would have served (the policy's canary then only checks live health)")
    samples: ReplaySamples = Field(default_factory=ReplaySamples, description="per-record samples (held-out)")

    @field_validator("champion_version", mode="before")
    @classmethod
    def _plain_when_unnamed(cls, value: Any) -> Any:
        return PLAIN if value is None or value == "" else value  # as the loop has always read it

    @model_validator(mode="after")
    def _consistent(self) -> "ReplayEvidence":
        if self.greedy_records is not None and self.greedy_records > self.records:
            raise ValueError(f"greedy_records {self.greedy_records} > records {self.records}")
        if self.exact and not (self.greedy_records == self.records > 0):
            raise ValueError(f"exact with greedy_records {self.greedy_records} of {self.records} records")
        if self.evidence == PREQUENTIAL and (self.samples.candidate or self.samples.champion):
            raise ValueError("test-then-train evidence carries no samples in head.json (its evidence file does)")
        return self

    @property
    def prequential(self) -> bool:
        """Test-then-train: the samples grow in the candidate's evidence file."""
        return self.evidence == PREQUENTIAL

    @classmethod
    def from_metrics(cls, metrics: Optional[Mapping], where: str = "head.json") -> Optional["ReplayEvidence"]:
        """The evidence of a head.json's metrics; None when it has no replay block. A malformed block is refused
        (EvidenceError naming `where` and the field)."""
        block = (metrics or {}).get("replay")
        if not block:
            return None
        try:
            return cls.model_validate(block)
        except ValidationError as e:
            raise EvidenceError(where, _reason(e, "metrics.replay.")) from None

    @classmethod
    def from_head_meta(cls, meta: Any) -> Optional["ReplayEvidence"]:
        """The evidence of a head version (checkpoint.HeadMeta or registry.HeadVersion: `.version`, `.metrics`)."""
        return cls.from_metrics(meta.metrics, f"{meta.version}/head.json")

    def to_metrics(self) -> dict:
        """The block head.json's `metrics.replay` holds (JSON types)."""
        return self.model_dump(mode="json", exclude_unset=True)


# ---- the test-then-train evidence file -------------------------------------------------------------------
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
        raise EvidenceError(path, _reason(e)) from None
    if ev.version != version:
        raise EvidenceError(path, f"names version {ev.version!r}, not {version!r}")
    return ev


__all__ = ["EVIDENCE_DIR", "HELDOUT", "PREQUENTIAL", "CandidateEvidence", "DomainSummary", "EvidenceError",
           "EvidenceKind", "ReplayEvidence", "ReplaySample", "ReplaySamples", "ReplaySummary", "ReplayTree", "Row",
           "evidence_path", "read_evidence", "write_evidence"]
