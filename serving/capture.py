"""Capture: which finished requests go to the feature store, with or without hidden states.

Owns: `CapturePolicy` (pydantic config: fraction, low-acceptance bias, byte budget, opt-out rules)
and `CaptureSampler`, the per-replica decision state (a token bucket over bytes and a seeded RNG).
Must not touch: the store (the server hands records to `StoreWriter.put`, which never blocks or
raises), the engine, HTTP.

The decision is made twice. Before a request runs, `wants_hidden` says whether the engine should
collect aux hidden states at all (the request consented and the budget is not exhausted); after it
finishes, `decide` looks at its accept length: requests that drafted with a head and accepted little
(below `low_accept_below`) are always kept while the budget allows, the rest are kept with
probability `fraction`. Kept records take their bytes from the bucket; a record the bucket cannot
pay for is skipped (counted) or, with `keep_uncaptured_tokens`, stored as tokens only.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from pydantic import BaseModel, ConfigDict, Field

from adaptive_eagle.versions import PLAIN


class CapturePolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(True, description="False: nothing is captured (opt-outs are still counted)")
    fraction: float = Field(0.1, ge=0.0, le=1.0, description="share of ordinary requests kept with hidden states")
    low_accept_below: float = Field(1.5, ge=1.0, description="requests that drafted with a head and whose accept "
                                    "length is below this are always kept (budget permitting); 1.0 turns the bias off")
    budget_bytes_per_s: float = Field(8 << 20, gt=0, description="sustained capture budget (record bytes/s)")
    burst_s: float = Field(10.0, gt=0, description="the bucket holds this many seconds of budget")
    keep_uncaptured_tokens: bool = Field(False, description="store requests not kept with hidden states as "
                                         "tokens-only records (the trainer regenerates features)")
    seed: Optional[int] = Field(None, description="RNG seed of the sampling (tests); None: random")

    @property
    def burst_bytes(self) -> float:
        return self.budget_bytes_per_s * self.burst_s


@dataclass(frozen=True)
class CaptureDecision:
    keep: bool  # hand a record to the store
    hidden: bool  # ... with its aux hidden states
    reason: str  # "low-accept" | "sampled" | "not sampled" | "over budget" | "opted out" | "disabled"

    @property
    def label(self) -> str:
        """The `captured` value reported to the client."""
        if self.reason == "opted out":
            return "opted_out"
        return "hidden" if self.hidden else "tokens" if self.keep else "no"


class CaptureSampler:
    """Per-replica capture state. Thread-safe; `clock` is injectable for tests."""

    def __init__(self, policy: CapturePolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._rng = random.Random(policy.seed)
        self._lock = threading.Lock()
        self._tokens = policy.burst_bytes
        self._last = clock()
        self.counts = {"hidden": 0, "tokens": 0, "skipped": 0, "over_budget": 0, "opted_out": 0,
                       "low_accept": 0, "bytes": 0}

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.policy.burst_bytes, self._tokens + (now - self._last) * self.policy.budget_bytes_per_s)
        self._last = now

    def wants_hidden(self, consent: bool) -> bool:
        """Should the engine collect hidden states for a request about to start?"""
        p = self.policy
        if not (p.enabled and consent) or (p.fraction == 0 and p.low_accept_below <= 1.0):
            return False
        with self._lock:
            self._refill()
            return self._tokens > 0

    def decide(self, accept_length: float, head_version: str, hidden_bytes: int, token_bytes: int,
               consent: bool = True) -> CaptureDecision:
        """Keep this finished request? `hidden_bytes`: its aux hidden states (0 if none were collected)."""
        p = self.policy
        with self._lock:
            if not consent:
                self.counts["opted_out"] += 1
                return CaptureDecision(False, False, "opted out")
            if not p.enabled:
                return CaptureDecision(False, False, "disabled")
            self._refill()
            low = head_version != PLAIN and accept_length < p.low_accept_below
            wanted = low or self._rng.random() < p.fraction
            if wanted and hidden_bytes > 0 and self._tokens >= hidden_bytes + token_bytes:
                self._tokens -= hidden_bytes + token_bytes
                self.counts["hidden"] += 1
                self.counts["low_accept"] += int(low)
                self.counts["bytes"] += hidden_bytes + token_bytes
                return CaptureDecision(True, True, "low-accept" if low else "sampled")
            reason = "over budget" if wanted else "not sampled"
            self.counts["over_budget" if wanted else "skipped"] += 1
            if p.keep_uncaptured_tokens and self._tokens >= token_bytes:
                self._tokens -= token_bytes
                self.counts["tokens"] += 1
                self.counts["bytes"] += token_bytes
                return CaptureDecision(True, False, reason)
            return CaptureDecision(False, False, reason)

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counts, budget_left_bytes=int(self._tokens))
