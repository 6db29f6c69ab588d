"""What the engine is asked and what it answers: `GenerationRequest` in, `StepOutput`s then one
`GenerationResult` out.

Owns: those three types and the mapping from the engine's keyword API to a request
(`GenerationRequest.of`). Must not touch: models, decoding, networking (serving builds a request from
its own `DecodeRequest`; nothing here knows HTTP or pydantic).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from adaptive_eagle.trace import SamplingParams, TraceRecord, VerifyStep

if TYPE_CHECKING:  # types only: this module stays torch-free
    import torch

    from adaptive_eagle.binding import HeadBinding
    from adaptive_eagle.grammar import Grammar


@dataclass(frozen=True)
class GenerationRequest:
    """One request to `SpeculativeEngine.run` / `stream` / `generate`."""

    prompt: Any  # text (chat-templated as one user turn), chat messages [{role, content}], or token ids
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # stop strings: the output ends after the token that completes one
    capture: bool = False  # keep the target's hidden states of every position in the trace (the trainer's features)
    request_id: str = "req"
    tenant: str = "default"
    domain: str | None = None  # tag carried into the trace (code, math, ...)
    # False: the request opted out of capture: its trace says so and its output stays out of the
    # cross-request suffix index (it must not feed other requests' drafts either)
    consent: bool = True
    generator: "torch.Generator | None" = None  # sampling randomness (None: torch's default generator)
    binding: "HeadBinding | None" = None  # decode with this prepared head (`engine.bind`) instead of the installed one
    grammar: "Grammar | None" = None  # constrain the output (`engine.grammar(response_format)`): grammar.py

    def __post_init__(self) -> None:
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a sequence of strings, not {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))

    @classmethod
    def of(cls, prompt, sampling: SamplingParams | None = None, stop: Sequence[str] | None = None,
           capture: bool = False, request_id: str = "req", generator=None, tenant: str = "default",
           index_output: bool = True, binding=None, grammar=None) -> "GenerationRequest":
        """The engine's keyword API as a request (`prompt` may already be one: returned as it is, and then no
        other argument may be given). index_output=False: the request opted out (`consent`)."""
        if isinstance(prompt, GenerationRequest):
            given = (sampling, stop, capture, request_id, generator, tenant, index_output, binding, grammar)
            if given != (None, None, False, "req", None, "default", True, None, None):
                raise TypeError("pass either a GenerationRequest or keyword arguments, not both")
            return prompt
        return cls(prompt, sampling or SamplingParams(), tuple(stop or ()), capture, request_id, tenant,
                   consent=index_output, generator=generator, binding=binding, grammar=grammar)


@dataclass(frozen=True)
class StepOutput:
    """What one verify step adds to the output, as `run` yields it."""

    token_ids: tuple[int, ...]  # tokens committed (the EOS or the stop-completing token included)
    text: str  # text that became final: never part of a stop string, never half a character


@dataclass
class GenerationResult:
    text: str  # the generated tokens decoded (EOS and special tokens skipped; a stop string is still in it)
    token_ids: list[int]  # generated tokens
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    trace: TraceRecord
    elapsed_s: float
    steps: list[VerifyStep] = field(default_factory=list)
    output_text: str = ""  # `text` cut at its first stop string: what a client is shown
    constraint_s: float = 0.0  # seconds the grammar's pruning and masks took (a constrained request)

    @property
    def head_version(self) -> str | None:
        """The head this request was bound to (None: plain decoding)."""
        return self.trace.head_version

    @property
    def compute(self) -> str:
        """How the target ran, e.g. "float32" or "float32+fp16-weights"."""
        return self.trace.compute

    @property
    def lossless(self) -> str:
        """"exact", or "lossless up to bf16 rounding"."""
        return self.trace.lossless

    @property
    def accept_length_mean(self) -> float:
        return self.trace.accept_length_mean

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0
