"""RequestSample: one finished request as the policy sees it (the hand-off from servers and from the
trainer's acceptance replay to the gates). Plain Python only.

Vocabulary: accept length = tokens committed per verify step, bonus token included (1.0 = no
speed-up; plain decoding scores exactly 1.0). A head version is a registry name; the special
version "none" means plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptive_eagle.versions import PLAIN


@dataclass(frozen=True)
class RequestSample:
    accept_length: float  # tokens per verify step, bonus included, >= 1.0
    head_version: str = PLAIN  # the head the request was bound to ("none": plain decoding)
    domain: str | None = None  # the request's domain tag, if any
    request_id: str = ""  # pairs a champion and a candidate score of the same record (replay)
    tpot_s: float | None = None  # live requests: wall seconds per output token; None for replay
    finished_at: float = 0.0  # unix seconds
    tokens: int = 0  # output tokens
    # context position: prompt tokens + half the generated tokens (adaptive_eagle.positions.context_position),
    # the same for both heads of a replayed record; None: not known (older evidence), left out of context slices
    context: int | None = None

    def __post_init__(self) -> None:
        if not self.accept_length >= 1.0:
            raise ValueError(f"accept_length must be >= 1.0 (bonus token included), got {self.accept_length}")
        if self.tpot_s is not None and not self.tpot_s >= 0:
            raise ValueError(f"tpot_s must be >= 0, got {self.tpot_s}")
        if self.context is not None and not self.context >= 0:
            raise ValueError(f"context must be >= 0 tokens (or None: not known), got {self.context}")

