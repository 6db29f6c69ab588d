"""What travels between the gateway and a replica: one decode request in, a stream of events out.

Owns: `DecodeRequest` (pydantic: it crosses the gateway -> replica boundary, a Ray process boundary
when replicas are actors), the events a replica yields (`Started`, `Delta`, `Finished`, `Refused`),
`SpecMetrics` (the speculative metrics every response carries), `ServerStatus`. Must not touch:
HTTP (the gateway maps these to OpenAI JSON), engines, the store.

Vocabulary: accept length = tokens committed per verify step, bonus token included (1.0 = plain
decoding speed); draft tokens = tokens verified (tree sizes summed); accepted drafts = draft tokens
the target kept. Head version "none" = plain decoding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adaptive_eagle.trace import SamplingParams

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a sampling seed is a signed 64-bit integer (torch.Generator, the store)
# Sampling parameters too close to their limit for float32 logits decode as that limit: a temperature this small
# is greedy decoding (smaller ones overflow logits / temperature), a top_p this small keeps the top token alone
# (as any smaller one would; below float32's smallest number it would keep none and sample from NaNs).
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6


class DecodeRequest(BaseModel):
    """One request as a replica sees it. The prompt is exactly one of `messages` (chat-templated),
    `prompt` text (tokenized as is) or `prompt` token ids."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str = Field(..., min_length=1, description="unique id (also the trace's request_id)")
    messages: Optional[tuple[dict[str, str], ...]] = Field(None, description="chat messages {role, content}; an "
                                                           "assistant's calls as tool_calls (JSON text), a tool "
                                                           "message's tool_call_id (serving.tools.wire_messages)")
    prompt: Optional[Union[str, tuple[int, ...]]] = Field(None, description="raw text or token ids")
    temperature: float = Field(0.0, ge=0.0, description=f"0 = greedy (so is anything below {MIN_TEMPERATURE:g})")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description=f"nucleus mass (below {MIN_TOP_P:g}: the top token alone)")
    top_k: int = Field(0, ge=0, description="0 = off")
    max_tokens: int = Field(256, ge=1)
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX, description="sampling seed (None: from the clock)")
    stop: tuple[str, ...] = Field((), description="stop strings; not included in the output")
    tenant: str = Field("default", min_length=1)
    domain: Optional[str] = Field(None, description="domain tag carried into the trace (code, math, ...)")
    capture: bool = Field(True, description="False: the request opted out; never stored, never indexed")
    head: Optional[str] = Field(None, description="routing only: the head version the caller asked for")
    response_format: Optional[str] = Field(None, description="constrains the output: the OpenAI response_format "
                                           "as JSON text (json_object or json_schema); None: free text")
    tools: Optional[str] = Field(None, description="the tools the prompt offers, as JSON text {\"tools\": [...], "
                                 "\"parallel\": bool} (serving.tools.wire_tools); rendered by the replica for its "
                                 "target's template; None: none")

    @model_validator(mode="after")
    def _tools_need_messages(self) -> "DecodeRequest":
        if self.tools is not None and self.messages is None:
            raise ValueError("tools are rendered into chat messages: give messages with them")
        return self

    @field_validator("temperature")
    @classmethod
    def _greedy_near_zero(cls, temperature: float) -> float:
        return 0.0 if temperature < MIN_TEMPERATURE else temperature

    @field_validator("top_p")
    @classmethod
    def _top_token_near_zero(cls, top_p: float) -> float:
        return max(top_p, MIN_TOP_P)

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=self.max_tokens, seed=self.seed)


@dataclass(frozen=True)
class SpecMetrics:
    """The speculative metrics of one finished request (the `adaptive_eagle` field of a response)."""

    head_version: str  # the head the request was bound to ("none": plain decoding)
    accept_length: float  # tokens per verify step, bonus included
    verify_steps: int
    draft_tokens: int  # tokens verified, summed over steps
    accepted_drafts: int  # draft tokens the target kept
    backend: str = "reference"
    replica: str = ""
    elapsed_s: float = 0.0
    tpot_s: float = 0.0  # wall seconds per output token after the first (the decode phase; 0 with one token)
    tokens_per_s: float = 0.0
    captured: str = "no"  # "hidden" | "tokens" | "no" | "opted_out" | "dropped"
    domain: Optional[str] = None
    # prompt tokens + half the generated tokens (adaptive_eagle.positions.context_position); None: not known
    context_position: Optional[int] = None
    # per context bucket its verify steps started in: (bucket label, verify steps, accepted drafts)
    by_context: tuple[tuple[str, int, int], ...] = ()
    ttft_s: float = 0.0  # wall seconds from the replica starting the request to its first token (the prefill)
    # verify steps that verified no draft (the cost model found no draft worth its verify cost: a plain step)
    plain_steps: int = 0
    arm: str = "served"  # "holdback": decoded by the frozen baseline head (serving.holdback_fraction)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Started:
    request_id: str
    prompt_tokens: int
    replica: str


@dataclass(frozen=True)
class Delta:
    text: str  # new text since the previous delta
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Finished:
    request_id: str
    text: str  # the whole completion (stop string cut off)
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    spec: SpecMetrics


@dataclass(frozen=True)
class Refused:
    """A request the replica will not run: `status` is the HTTP status the gateway answers with."""

    status: int
    message: str
    param: Optional[str] = None  # the request field at fault
    code: str = "invalid_request"


Event = Union[Started, Delta, Finished, Refused]


@dataclass(frozen=True)
class ServerStatus:
    replica: str
    head_version: str
    backend: str
    running: int  # requests decoding now, at most max_inflight
    waiting: int
    served: int
    refused: int
    failed: int
    cancelled: int
    capture: dict = field(default_factory=dict)  # CaptureSampler counters
    store: Optional[dict] = None  # StoreWriter stats (None: no store)
    info: dict = field(default_factory=dict)  # the backend's info()
    pid: Optional[int] = None  # the replica's process (a new one after Ray restarted its actor)
    max_inflight: int = 1  # requests it decodes at once (its backend's capacity: 1 for the reference engine)
    grammar_failed: int = 0  # constrained requests ended because their format could not go on (a 400)

    def to_json(self) -> dict:
        return asdict(self)
