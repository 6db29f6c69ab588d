"""EngineConfig: how the reference engine drafts (tree shape, model-free sources, cost awareness).

Owns: the engine's configuration and its checks (frozen: never mutated after construction). Must not
touch: models, decoding, I/O. `adaptive_eagle.engine` re-exports it (its long-standing import path).
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptive_eagle.costmodel import PinnedCosts


@dataclass(frozen=True)
class EngineConfig:
    depth: int = 5  # draft steps per tree
    topk: int = 4  # children per expanded node, and frontier width
    num_draft_tokens: int = 16  # nodes kept per tree (verified in one target forward)
    min_path_prob: float = 0.02  # stop drafting deeper once every frontier path is less likely than this
    prompt_lookup: bool = True  # merge suffix-match continuations from the request's context
    lookup_max_tokens: int = 16
    lookup_min_ngram: int = 2
    # verify only the part of each tree that pays for itself on this machine (costmodel.py): the
    # target's forward cost by size is measured when the engine starts and followed online
    cost_aware: bool = True
    # charge these costs instead of timing this machine: drafting decisions that depend on acceptance
    # alone, the same on any machine and under any load (tests, paired benchmarks); None: measure
    pinned_costs: PinnedCosts | None = None
    # merge continuations of recently served outputs (cross-request suffix index, same tenant when
    # the index isolates tenants); the index is updated when a request finishes
    suffix_drafting: bool = True
    # where acceptance calibrations persist per (head version, target, compute mode); None: the
    # cache dir's calibration/; "" disables persistence
    calibration_dir: str | None = None
    # prompts are prefilled in blocks of this many tokens at absolute positions, and whole blocks are kept
    # across requests (prefix_cache.py) up to prefix_cache_mb of tensors (0: none kept): a session's later
    # turn prefills only its new tokens, with the bits a fresh prefill computes
    prefill_block: int = 256
    prefix_cache_mb: float = 512.0

    def __post_init__(self) -> None:
        if self.prefill_block < 1:
            raise ValueError(f"prefill_block must be >= 1 token, got {self.prefill_block}")
        if not self.prefix_cache_mb >= 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {self.prefix_cache_mb}")
        if self.depth < 1 or self.topk < 1 or self.num_draft_tokens < 1:
            raise ValueError("depth, topk and num_draft_tokens must be >= 1")
        if self.lookup_max_tokens < 0 or self.lookup_min_ngram < 1:
            raise ValueError("lookup_max_tokens must be >= 0 and lookup_min_ngram >= 1")
        if isinstance(self.pinned_costs, dict):  # from a config file or a pydantic dump
            object.__setattr__(self, "pinned_costs", PinnedCosts(**self.pinned_costs))
        if self.pinned_costs is not None and not isinstance(self.pinned_costs, PinnedCosts):
            raise ValueError(f"pinned_costs must be a PinnedCosts or None, not {type(self.pinned_costs).__name__}")

    @classmethod
    def plain(cls) -> "EngineConfig":
        """Plain decoding: no drafting of any kind (for baselines)."""
        return cls(prompt_lookup=False, suffix_drafting=False)
