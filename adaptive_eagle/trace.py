"""TraceRecord: what one finished request tells the loop (the contract between servers, the
feature store and the trainer).

Owns: the record dataclasses and their invariants. Must not touch: encoding (feature_store owns the
Arrow schema and hidden-state codecs), models, I/O. Plain Python and NumPy only.

Vocabulary (see verify.py for the decoding side): a verify step drafts a tree of `tree_size`
tokens, the target accepts a path of `accept_length` draft tokens (then adds one bonus token);
`rejected_*` describe the first draft token the target refused on that step (-1 / NaN when every
drafted token on the path was accepted or nothing was drafted).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

# major.minor; readers refuse an unknown major (1.1: compute, lossless; 1.2: final_hidden; 1.3: spans)
TRACE_SCHEMA_VERSION = "1.3"
# what a span of a record's tokens is: in the prompt, a message by its role, the rendered tool schemas ("tools":
# the system message that carries them) or a tool's result ("tool_output"); the answer, free model text
# ("model") or decoded under a grammar ("constrained": a response_format or a required / named tool call)
SPAN_KINDS = ("system", "user", "assistant", "tools", "tool_output", "model", "constrained")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 256
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.max_tokens <= 0:
            raise ValueError(f"invalid sampling params {self}")


@dataclass(frozen=True)
class VerifyStep:
    tree_size: int  # draft tokens verified in this step's single target forward
    accept_length: int  # draft tokens accepted (the bonus token not counted)
    accepted_depth: int  # depth of the deepest accepted node (== accept_length for a path)
    rejected_token: int = -1  # target id of the first refused draft token, -1 if none
    rejected_draft_prob: float = math.nan  # the draft's probability of that token
    rejected_target_prob: float = math.nan  # the target's probability of that token

    def __post_init__(self) -> None:
        if not 0 <= self.accept_length <= max(self.tree_size, 0) or self.tree_size < 0:
            raise ValueError(f"invalid verify step {self}")


@dataclass(frozen=True)
class TraceRecord:
    request_id: str
    target_fingerprint: str
    head_version: str | None  # None: plain decoding
    backend: str  # "reference" | "sglang" | ...
    input_ids: tuple[int, ...]  # prompt + generated tokens
    loss_mask: tuple[int, ...]  # 1 on generated tokens
    steps: tuple[VerifyStep, ...] = ()
    tenant: str = "default"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    domain: str | None = None  # optional tag (code, math, english, ...)
    capture_consent: bool = True  # False: the request opted out; never stored
    # [T, n_aux * H] float32 aux features of positions 0..T-1, if captured. T = len(input_ids) - 1
    # when the last token never went through the target (decoding stops before its forward).
    aux_hidden: np.ndarray | None = None
    aux_layer_ids: tuple[int, ...] = ()  # input-of-layer convention (adaptive_eagle.targets)
    # [T, H] float32 final-norm hidden states of the same positions (the LM head's input), if captured:
    # with them the trainer knows the target's distribution at every position without a target forward
    final_hidden: np.ndarray | None = None
    created_at: float = field(default_factory=time.time)  # unix seconds
    compute: str = ""  # how the target ran, e.g. "float32+fp16-weights" ("" = not recorded)
    lossless: str = ""  # "exact", or "lossless up to bf16 rounding" when the target ran in bf16
    # (start, end, kind): token ranges [start, end) of input_ids and what they are (SPAN_KINDS), in order and
    # disjoint; tokens in no span (a chat template's own framing) are unmarked. () = not recorded
    spans: tuple[tuple[int, int, str], ...] = ()
    schema_version: str = TRACE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError("input_ids and loss_mask differ in length")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask must be 0/1")
        if self.aux_hidden is not None:
            if self.aux_hidden.ndim != 2 or self.aux_hidden.shape[0] not in (len(self.input_ids), len(self.input_ids) - 1):
                raise ValueError(f"aux_hidden shape {self.aux_hidden.shape} does not match {len(self.input_ids)} tokens")
            if not self.aux_layer_ids:
                raise ValueError("aux_hidden needs aux_layer_ids")
        end = 0
        for start, stop, kind in self.spans:
            if kind not in SPAN_KINDS or not end <= start < stop <= len(self.input_ids):
                raise ValueError(f"invalid span ({start}, {stop}, {kind!r}) of {len(self.input_ids)} tokens: spans are "
                                 f"in order, disjoint and non-empty, kinds from {', '.join(SPAN_KINDS)}")
            end = stop
        if self.final_hidden is not None:
            if self.final_hidden.ndim != 2 or self.final_hidden.shape[0] not in (len(self.input_ids), len(self.input_ids) - 1):
                raise ValueError(f"final_hidden shape {self.final_hidden.shape} does not match {len(self.input_ids)} tokens")
            if self.aux_hidden is not None and self.aux_hidden.shape[0] != self.final_hidden.shape[0]:
                raise ValueError(f"final_hidden covers {self.final_hidden.shape[0]} positions, aux_hidden "
                                 f"{self.aux_hidden.shape[0]}")

    @property
    def generated_tokens(self) -> int:
        return int(sum(self.loss_mask))

    @property
    def accept_length_mean(self) -> float:
        """Mean tokens per verify step, bonus included (1.0 = no speed-up)."""
        return float(np.mean([s.accept_length + 1 for s in self.steps])) if self.steps else 1.0

    def without_hidden(self) -> "TraceRecord":
        return replace(self, aux_hidden=None, aux_layer_ids=(), final_hidden=None)
