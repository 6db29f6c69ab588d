"""ServingConfig: the one pydantic model that configures the gateway and its replicas (it crosses
config files and processes). Immutable; every field documented and range-checked.

Owns: the serving settings and their defaults. Must not touch: building anything (gateway.py and
replicas.py read it).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from feature_store.config import StoreConfig
from serving.capture import CapturePolicy
from serving.sglang_backend import SGLangConfig


class EngineParams(BaseModel):
    """The reference engine's tree parameters (adaptive_eagle.engine.EngineConfig)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    depth: int = Field(5, ge=1, description="draft steps per tree")
    topk: int = Field(4, ge=1, description="children per expanded node, and frontier width")
    num_draft_tokens: int = Field(16, ge=1, description="nodes verified per target forward")
    cost_aware: bool = Field(True, description="verify only the part of each tree that pays on this machine")
    prompt_lookup: bool = Field(True, description="merge suffix-match continuations from the request's context")
    suffix_drafting: bool = Field(True, description="merge continuations of recently served outputs")
    calibration_dir: Optional[str] = Field(None, description="acceptance calibrations (None: cache dir; '': off)")
    prefill_block: int = Field(256, ge=1, description="prompts are prefilled in blocks of this many tokens at "
                               "absolute positions; whole blocks are kept across requests (the prefix cache)")
    prefix_cache_mb: float = Field(512.0, ge=0, description="the prefix cache's budget of target KV and features "
                                   "per replica, MiB (0: off); least recently used blocks are evicted")


class ServingConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="gateway bind address")
    port: int = Field(8000, ge=0, le=65535, description="gateway port (0: any free port)")
    model_name: str = Field("adaptive-eagle", min_length=1, description="the model id clients pass as `model`")
    replicas: int = Field(1, ge=1, le=256, description="decode replicas (each takes its backend's max_inflight "
                          "at once: 1 for the reference engine, SGLang's batch for an SGLang replica)")
    queue_size: int = Field(16, ge=0, description="requests that may wait for a free replica; more: 429")
    max_prompt_tokens: int = Field(2048, ge=1, description="longer prompts are refused (400)")
    swap_cpu_share: float = Field(0.25, gt=0, le=1, description="share of one core a reference replica's hot "
                                  "swap (checksum, checks, dtype conversion) may take while requests decode; 1: "
                                  "unpaced")
    max_tokens_limit: int = Field(1024, ge=1, description="largest max_tokens a request may ask for")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none")
    request_timeout_s: float = Field(600.0, gt=0, description="a request waiting longer for a replica gets 429")
    first_event_timeout_s: float = Field(30.0, gt=0, description="a leased replica that has not started a request "
                                         "within this (an actor Ray cannot place, a hung process) has failed it: "
                                         "retried once on another replica, else 503; never a hang")
    admin_token: Optional[SecretStr] = Field(None, description="bearer token of /admin/*; None: admin disabled")
    api_keys: tuple[SecretStr, ...] = Field((), description="bearer keys for /v1/*; empty: open")
    capture: CapturePolicy = Field(default_factory=CapturePolicy, description="what goes to the feature store")
    store: Optional[StoreConfig] = Field(None, description="the feature store (None: nothing stored)")
    registry_path: Optional[str] = Field(None, description="head registry root (None: plain decoding only)")
    initial_head: Optional[str] = Field(None, description="head version at start (None: the registry champion)")
    holdback_fraction: float = Field(0.0, ge=0.0, le=0.5, description=(
        "share of requests each reference replica decodes with the frozen baseline head, next to the served one at "
        "the same time (the holdback arm: adapted vs frozen time per output token per domain, ae_loop_tpot_gain); "
        "0: no arm"))
    holdback_head: Optional[str] = Field(None, description=(
        "the frozen baseline (None: the oldest head in the starting head's lineage, the head the loop began from)"))
    target: str = Field("smollm2-135m", description="built-in target name or a local model directory")
    device: str = Field("cpu", description="where reference replicas run: 'cpu', 'auto' (CUDA when present), "
                        "'cuda', 'cuda:1', ...")
    backend: Literal["reference", "sglang"] = Field("reference", description="decoding backend of the replicas")
    sglang: Optional[SGLangConfig] = Field(None, description="the SGLang server of each replica (backend "
                                           "'sglang'; replica i uses port + i)")
    engine: EngineParams = Field(default_factory=EngineParams, description="reference engine tree parameters")
    live_samples_max: int = Field(40_000, ge=1, description=(
        "per-head finished-request samples kept for the policy (an evidence canary at canary_fraction 0.1 that runs to "
        "4,000 candidate requests needs 36,000 of the champion's)"))

    @model_validator(mode="after")
    def _check(self) -> "ServingConfig":
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens exceeds max_tokens_limit")
        if self.backend == "sglang" and self.sglang is None:
            raise ValueError("backend 'sglang' needs the sglang section (model_path, draft_model_path, port, ...)")
        return self
