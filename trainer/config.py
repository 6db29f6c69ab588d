"""NearlineConfig: the one pydantic model that configures the near-line trainer (it crosses config
files and the Ray actor boundary). Immutable; every field documented and range-checked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from feature_store.config import StoreConfig
from trainer.replay import TreeParams


class NearlineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    registry: str = Field(..., description="head registry root (a local path, or a shared filesystem in a cluster)")
    work_dir: str = Field(..., description="the trainer's checkpoint directory (resumes from here after a crash)")
    store: StoreConfig = Field(..., description="the feature store to tail")
    group: str = Field("trainer", min_length=1, description="store consumer group")
    consumer: str = Field("trainer-0", min_length=1, description="consumer name within the group")
    target: Optional[str] = Field(None, description="built-in target name or local HF dir; None: the champion's")
    base_head: Optional[str] = Field(
        None, description="head version directory to fine-tune while the champion is 'none' (plain decoding); "
        "None: build a new head from the traffic's own tokens")
    cold_start_records: int = Field(32, ge=1, description="records to collect before a head is built from scratch")

    # data
    positions: Literal["generated", "all", "new"] = Field(
        "generated", description="train where the target produced the token (the distribution drafts are judged "
        "on), or on the prompt's positions too (more rows, but the target's guess at a user's next word); 'new': "
        "the prompt's too, but each prefix once (an agent's session re-sent every turn trains its history once, "
        "not once a turn: trainer/traffic.py)")
    max_len: int = Field(8192, ge=16, le=32768, description=(
        "tokens per record (longer ones are cut): agents' long sessions train at the length they are served "
        "(a trainer capped at 1,024 lost 7% accept length past 1k tokens); TTT's attention is chunked, so "
        "memory grows linearly (about 5 GiB for an 8k-token row on a CPU); a row past batch_tokens is a "
        "batch of its own"))
    batch_tokens: int = Field(4096, ge=64, description="padded tokens per batch")
    min_fresh_tokens: int = Field(1024, ge=1, description="new-traffic tokens that make a batch worth a step")
    max_fresh_age_s: float = Field(300.0, gt=0, description=(
        "a record waiting longer than this for a fresh step (the trainer is behind the traffic) goes straight "
        "into the replay buffer instead, so steps train on recent traffic and the backlog stays bounded"))
    replay_ratio: float = Field(0.25, ge=0, lt=1, description="share of each batch's rows drawn from the replay buffer")
    replay_per_domain: int = Field(256, ge=1, description="records the replay buffer keeps per domain")
    replay_max_bytes: int = Field(512 << 20, ge=1 << 16, description="cap on the replay buffer's encoded bytes")
    max_passes: float = Field(4.0, ge=1, le=100, description="while no new traffic comes, keep training on the "
                              "buffer until trained tokens reach this many times the tokens received")
    evidence: Literal["prequential", "heldout"] = Field("prequential", description=(
        "how candidates are judged. 'prequential' (test-then-train): every record is first replayed by the "
        "champion and by each candidate snapshot gathering evidence, then trained on; no record is withheld, a "
        "snapshot's evidence comes from records it never trained on, and the policy's sequential offline gate "
        "re-reads it as it grows. 'heldout': heldout_percent of the records are never trained on, and a "
        "candidate is replayed once on them when it is written"))
    max_pending_candidates: int = Field(2, ge=1, le=16, description=(
        "prequential: snapshots gathering evidence at once (each record is replayed once more per snapshot); a "
        "newer one closes the evidence of the older snapshot whose rows lead the champion least"))
    candidate_evidence_records: int = Field(2000, ge=1, description=(
        "prequential: a snapshot's evidence closes after this many records (at least policy.min_samples; the "
        "policy decides on it by then)"))
    heldout_percent: int = Field(10, ge=1, le=50, description="evidence 'heldout': records held out (by request "
                                 "id) for acceptance replay")
    heldout_per_domain: int = Field(48, ge=4, description="most recent held-out records kept per domain (at least "
                                    "min_candidate_heldout; a stack keeps max(48, policy.min_samples))")

    # optimisation (trainer.step)
    lr: float = Field(2e-4, gt=0, le=1.0, description="AdamW learning rate after warmup (constant: traffic never "
                      "ends); bench/adapt.py on captured English -> code traffic, generated positions, 4 CPU-min: "
                      "2e-4 beat 1e-4 and 5e-5 on held-out code and English alike")
    warmup_steps: int = Field(5, ge=0, description="linear warmup after every (re)start from a champion")
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    ttt_steps: int = Field(7, ge=1, le=16)
    step_decay: float = Field(0.8, gt=0, le=1)
    max_loss_rows: Optional[int] = Field(1024, ge=1, description="chains scored per TTT step (None: all)")
    bf16: Optional[bool] = Field(None, description="bf16 autocast; None: on CUDA and on CPUs that multiply bf16 in "
                                 "hardware (AVX512-BF16/AMX), as the offline trainer")

    # candidates and evaluation
    candidate_every_tokens: int = Field(100_000, ge=1, description="write a candidate after this many trained tokens")
    candidate_every_minutes: float = Field(10.0, gt=0, description="... or after this many minutes of training")
    min_candidate_tokens: int = Field(4096, ge=1, description="never write a candidate with fewer trained tokens")
    min_candidate_heldout: int = Field(20, ge=1, description="evidence 'heldout': never write a candidate before this many held-out "
                                       "records can score it (the policy's min_samples: a candidate scored on "
                                       "fewer is rejected for lack of data, a wasted candidate)")
    candidate_prefix: str = Field("nl", pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,40}$",
                                  description="candidate version names start with this")
    tree_depth: int = Field(5, ge=1, le=16, description="replay tree depth (the serving tree)")
    tree_topk: int = Field(4, ge=1, le=16, description="replay tree top-k")
    tree_draft_tokens: int = Field(16, ge=1, le=128, description="replay tree nodes")
    tree_min_path_prob: float = Field(0.02, ge=0, lt=1, description="replay: stop below this path probability")

    # drift signal
    drift_alpha: float = Field(0.05, gt=0, le=1, description="EWMA weight of a new record's accept length")
    drift_drop: float = Field(0.05, gt=0, lt=1, description="relative drop that flags a domain")
    drift_min_records: int = Field(20, ge=1, description="records of a domain before its level counts")
    drift_sustain: int = Field(10, ge=1, description="consecutive low records before a domain is flagged")
    drift_boost: float = Field(2.0, ge=1, description="batch weight of a flagged domain")

    # MoE growth (trainer/moe.py)
    moe_grow: bool = Field(False, description="grow an expert for a domain whose acceptance stays low (the head "
                           "becomes MoE-routed: the reference engine serves it, SGLang and vLLM cannot)")
    moe_max_experts: int = Field(4, ge=2, le=64, description="never grow a head beyond this many experts")
    moe_grow_after_records: int = Field(200, ge=1, description="consecutive records a domain must stay low "
                                        "(flagged by the drift monitor, or below the overall replayed accept "
                                        "length) before it gets an expert")

    # loop
    checkpoint_every_s: float = Field(30.0, gt=0, description="checkpoint (then ack the records used) this often")
    max_yield_s: float = Field(10.0, gt=0, description="the trainer waits while requests queue (yield_to), but "
                               "never longer than this at a stretch: then it takes one step (neither side starves)")
    champion_check_s: float = Field(5.0, gt=0, description="look for a champion change this often")
    read_batch: int = Field(64, ge=1, le=4096, description="records per store read")
    poll_ms: int = Field(200, ge=0, le=60_000, description="block this long on the store when idle")
    device: str = Field("auto", description="'auto' (CUDA when present), 'cpu', 'cuda', 'cuda:1', ...")
    store_backoff_initial_s: float = Field(0.5, gt=0, le=60, description="after a store error (StoreUnavailable) "
                                           "the loop waits this long before trying again, doubling with each "
                                           "error in a row (the status says degraded meanwhile)")
    store_backoff_max_s: float = Field(30.0, gt=0, le=3600, description="... up to this long between tries")
    store_max_errors: int = Field(60, ge=1, le=100_000, description="store errors in a row the loop rides out; "
                                  "one more ends the loop with an error (the actor then ends its process and Ray "
                                  "restarts it with a fresh connection). 60 at the default backoff: ~28 minutes")
    seed: int = 0

    # scale-out (trainer/scaleout.py)
    workers: int = Field(1, ge=1, le=1024, description="1: the step runs in the trainer's process; more: on a Ray "
                         "Train worker group of this size (TorchTrainer, DDP: each worker builds and trains a shard "
                         "of every batch, gradients averaged), one GPU a worker when device is CUDA")
    worker_cpus: float = Field(1.0, gt=0, le=256, description="Ray CPUs (and torch threads) of each worker")
    sequence_parallel: int = Field(1, ge=1, le=1024, description=(
        "1: each worker trains whole rows (data parallel). N > 1: every row of a step is split by position over "
        "the N workers (sequence parallel, trainer/seqpar.py: the keys and values pass round a ring, the loss and "
        "gradient are exactly the one-process ones), for records too long to train on one worker; N must equal "
        "workers, and the head must be dense (an MoE-routed champion is refused at its first step)"))

    @model_validator(mode="after")
    def _check(self) -> "NearlineConfig":
        if self.min_candidate_tokens > self.candidate_every_tokens:
            raise ValueError("min_candidate_tokens must be <= candidate_every_tokens")
        if self.min_candidate_heldout > self.heldout_per_domain:
            raise ValueError(f"heldout_per_domain: keeps {self.heldout_per_domain} held-out records per domain, fewer "
                             f"than min_candidate_heldout ({self.min_candidate_heldout}): traffic of one domain could "
                             f"never score a candidate. Set heldout_per_domain >= {self.min_candidate_heldout}")
        if self.store_backoff_max_s < self.store_backoff_initial_s:
            raise ValueError("store_backoff_max_s must be >= store_backoff_initial_s")
        if self.sequence_parallel > 1 and self.sequence_parallel != self.workers:
            raise ValueError(f"sequence_parallel {self.sequence_parallel} must be 1 or equal workers "
                             f"({self.workers}): each worker holds one position shard of every row (data and "
                             "sequence parallel groups together are not supported)")
        if self.workers > 1 and self.moe_grow:
            raise ValueError("moe_grow needs workers 1: growing an expert changes the head's parameters mid-run, "
                             "which a data-parallel worker group cannot follow")
        return self

    @property
    def tree(self) -> TreeParams:
        return TreeParams(self.tree_depth, self.tree_topk, self.tree_draft_tokens, self.tree_min_path_prob)

    @classmethod
    def from_file(cls, path: str | Path) -> "NearlineConfig":
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"trainer config {p} does not exist")
        text = p.read_text()
        if p.suffix in (".yaml", ".yml"):
            import yaml

            return cls.model_validate(yaml.safe_load(text))
        return cls.model_validate(json.loads(text))


__all__ = ["NearlineConfig"]
