"""PolicyConfig: the one pydantic model that configures the promotion policy (gates, canary, rollback
watch, cold start). It crosses config files and processes, so it is frozen, forbids unknown fields and
range-checks every field; an error names the field and its allowed range.

Owns: the policy's numbers and their meaning. Must not touch: the registry, the fleet, the log.

Units. Accept length is tokens committed per verify step, bonus token included (>= 1). Tolerances
and margins are fractions of the champion's value (0.02 = the candidate may be 2% lower), so one
setting means the same for accept length (higher is better) and, in the cold start, for wall time
per output token (lower is better).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from adaptive_eagle.positions import DEFAULT_EDGES

MAX_CONTEXT_EDGES = 16  # the context slice has at most this many buckets


class PolicyConfigError(ValueError):
    """A policy config was refused; the message names the field, the value and the allowed range."""


class PolicyConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # ---- the tail and its confidence interval ----
    tail_quantile: float = Field(0.05, gt=0.0, lt=0.5, description=(
        "quantile of per-request accept length that the gates compare (0.05: the 5th percentile, which sets "
        "P95 time per output token); in (0, 0.5)"))
    tail_statistic: Literal["quantile", "tail_mean"] = Field("tail_mean", description=(
        "'tail_mean': the tail is the mean of the lowest tail_quantile share of per-request accept length "
        "(expected shortfall: it averages ceil(q x n) requests instead of interpolating one or two, and its paired "
        "anytime-valid test promotes a head 5% better within about 1,200 records at q 0.05, "
        "docs/results/gate-sim-2026-12-07-epyc); 'quantile': the tail_quantile itself (its anytime-valid test is "
        "unpaired and needed more than 3,000 records for the same head); in {quantile, tail_mean}"))
    confidence_level: float = Field(0.95, gt=0.5, lt=1.0, description=(
        "one-sided confidence level of 'the candidate's tail is higher'; 1 - level is the false-promotion "
        "rate a gate allows; in (0.5, 1)"))
    bootstrap_resamples: int = Field(2000, ge=200, le=100_000, description=(
        "bootstrap resamples for the confidence interval of the tail difference; in [200, 100000]"))

    # ---- sample counts ----
    min_samples: int = Field(200, ge=20, le=10_000_000, description=(
        "fewest requests per head (champion and candidate) before the offline gate decides; in [20, 1e7]"))
    min_domain_samples: int = Field(100, ge=5, le=10_000_000, description=(
        "a domain is checked for regression only when both heads have this many of its requests; in [5, 1e7]"))

    # ---- regression tolerances (fractions of the champion's value) ----
    domain_tolerance: float = Field(0.03, ge=0.0, le=0.5, description=(
        "largest allowed drop of a domain's tail or mean, as a fraction of the champion's; in [0, 0.5]"))
    context_guard: bool = Field(True, description=(
        "true: the gates also slice both heads' requests by context position (prompt tokens + half the generated "
        "tokens, bucketed at context_edges) and reject a candidate whose mean in any bucket where both heads have "
        "min_domain_samples requests drops by more than domain_tolerance, so that a head that gains on short "
        "requests and loses on long ones is not promoted; requests without a context position (older evidence) "
        "are left out of the slice; in {true, false}"))
    context_edges: tuple[int, ...] = Field(DEFAULT_EDGES, description=(
        "bucket edges of the context slice in tokens (the last bucket is open: 8192 and more by default); in "
        f"2 to {MAX_CONTEXT_EDGES} integers, the first 0, strictly increasing"))
    mean_tolerance: float = Field(0.01, ge=0.0, le=0.5, description=(
        "largest allowed drop of the overall mean, as a fraction of the champion's; in [0, 0.5]"))

    # ---- live canary ----
    canary_fraction: float = Field(0.1, gt=0.0, le=0.5, description=(
        "fraction of live requests that decode with the candidate during a canary; in (0, 0.5]"))
    canary_min_requests: int = Field(200, ge=20, le=10_000_000, description=(
        "live requests per head (candidate and champion) before the canary decides; in [20, 1e7]"))
    canary_margin: float = Field(0.0, ge=0.0, le=0.2, description=(
        "0: the canary must itself show a significant tail gain, like the offline gate. > 0: a non-inferiority "
        "canary, which confirms live what the offline gate proved on paired replay: it passes when the "
        "interval's lower bound is above -margin x the champion's tail (unpaired live requests of different "
        "prompts cannot resolve a gain of a few percent in a few dozen requests); in [0, 0.2]"))

    canary_mode: Literal["auto", "evidence", "health"] = Field("auto", description=(
        "'evidence': the canary carries the evidence (canary_min_requests, the tail test below). 'health': the "
        "canary only checks that the candidate is healthy live (no collapse, no acceptance or latency harm "
        "beyond canary_health_margin) over canary_health_requests, because the offline gate's exact replay "
        "already proved the gain. 'auto': health when every record the candidate was replayed on was greedy "
        "(replay is exact), evidence otherwise; in {auto, evidence, health}"))
    canary_health_requests: int = Field(50, ge=5, le=10_000_000, description=(
        "live requests per head a health canary serves before it passes (it fails as soon as harm shows); "
        "in [5, 1e7]"))
    canary_health_margin: float = Field(0.1, gt=0.0, le=0.5, description=(
        "a health canary fails when the anytime bounds show the candidate's median accept length below the "
        "champion's, or its median time per output token above it, by more than this fraction; in (0, 0.5]"))
    sequential: bool = Field(True, description=(
        "true: the evidence canary looks at every tick from canary_min_requests on and decides as soon as its "
        "anytime-valid bounds (confidence sequences, policies/sequential.py) allow, up to canary_max_requests; "
        "false: one look at canary_min_requests with the bootstrap interval; in {true, false}"))
    canary_max_requests: int = Field(4000, ge=20, le=10_000_000, description=(
        "live requests per head after which a sequential evidence canary that has not decided is rejected as "
        "inconclusive; in [20, 1e7]"))

    offline_max_samples: int = Field(2000, ge=20, le=10_000_000, description=(
        "paired records after which a candidate whose test-then-train evidence (replayed as it arrives, judged "
        "by the sequential offline gate) has not decided is rejected as inconclusive; in [20, 1e7]"))

    # ---- rollback watch after a promotion ----
    rollback_window: int = Field(200, ge=20, le=10_000_000, description=(
        "requests of the new champion watched after a promotion before the watch ends; in [20, 1e7]"))
    collapse_min_requests: int = Field(20, ge=5, le=10_000_000, description=(
        "requests after which a collapse (mean accept length at or under collapse_accept_length) rolls back "
        "at once, without waiting for the whole window; in [5, 1e7]"))
    collapse_accept_length: float = Field(1.05, ge=1.0, le=2.0, description=(
        "mean accept length at or under which a head counts as collapsed (1.0 = nothing accepted); in [1, 2]"))
    rollback_margin: float = Field(0.05, gt=0.0, le=0.5, description=(
        "roll back when the new champion's tail is below the previous champion's baseline by more than this "
        "fraction, with the whole confidence interval below; in (0, 0.5]"))

    # ---- cold start (champion 'none') ----
    cold_start_tpot_quantile: float = Field(0.95, ge=0.5, lt=1.0, description=(
        "the cold-start gate compares this quantile of wall seconds per output token (0.95: P95 TPOT); a head "
        "replaces plain decoding only when it is lower than plain decoding's; in [0.5, 1)"))

    seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of the bootstrap resampling (reproducible gates); in [0, 2**32 - 1]")

    @field_validator("context_edges")
    @classmethod
    def _edges(cls, edges: tuple[int, ...]) -> tuple[int, ...]:
        if not 2 <= len(edges) <= MAX_CONTEXT_EDGES or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError(f"context_edges must be 2 to {MAX_CONTEXT_EDGES} integers, the first 0, strictly "
                             "increasing (e.g. 0, 512, 1024, 2048, 4096, 8192)")
        return edges

    @model_validator(mode="after")
    def _check(self) -> "PolicyConfig":
        if self.min_domain_samples > self.min_samples:
            raise ValueError(f"min_domain_samples ({self.min_domain_samples}) must be <= min_samples "
                             f"({self.min_samples})")
        if self.canary_max_requests < self.canary_min_requests:
            raise ValueError(f"canary_max_requests ({self.canary_max_requests}) must be >= canary_min_requests "
                             f"({self.canary_min_requests})")
        if self.offline_max_samples < self.min_samples:
            raise ValueError(f"offline_max_samples ({self.offline_max_samples}) must be >= min_samples "
                             f"({self.min_samples})")
        if self.collapse_min_requests > self.rollback_window:
            raise ValueError(f"collapse_min_requests ({self.collapse_min_requests}) must be <= rollback_window "
                             f"({self.rollback_window})")
        return self

    @classmethod
    def make(cls, **fields: Any) -> "PolicyConfig":
        """Construct, turning a pydantic error into a PolicyConfigError naming each field and its range."""
        try:
            return cls(**fields)
        except ValidationError as e:
            raise PolicyConfigError(explain(e)) from None

    @classmethod
    def from_file(cls, path: str | Path) -> "PolicyConfig":
        """Read a YAML (.yaml/.yml) or JSON file holding the fields (a mapping; missing fields keep their
        defaults). A missing file or bad field is a PolicyConfigError naming the path."""
        path = Path(path)
        if not path.is_file():
            raise PolicyConfigError(f"{path}: no such policy config file")
        text = path.read_text()
        try:
            if path.suffix.lower() in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as e:  # yaml.YAMLError or json.JSONDecodeError: both name the line
            raise PolicyConfigError(f"{path}: not valid {path.suffix.lstrip('.') or 'JSON'}: {e}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise PolicyConfigError(f"{path}: expected a mapping of policy fields, got {type(data).__name__}")
        try:
            return cls(**data)
        except ValidationError as e:
            raise PolicyConfigError(f"{path}: {explain(e)}") from None


def explain(error: ValidationError) -> str:
    """One line per bad field: its name, the value given, what is allowed (the field's description)."""
    lines = []
    for err in error.errors():
        name = ".".join(str(p) for p in err["loc"]) or "config"
        field = PolicyConfig.model_fields.get(name)
        allowed = f" (allowed: {field.description.rsplit('; ', 1)[-1]})" if field and field.description else ""
        given = f", got {err['input']!r}" if "input" in err and name != "config" else ""
        lines.append(f"{name}: {err['msg']}{given}{allowed}")
    return "; ".join(lines)


__all__ = ["PolicyConfig", "PolicyConfigError", "explain"]
