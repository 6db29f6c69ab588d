"""One request's decoding state and the typed hand-offs between the engine's named steps.

Owns: `DecodeState` (what a request carries from one verify step to the next: its binding, the
target's KV cache, the head's feed, the budget split, the committed tokens, the steps' records, the
captured hidden states, its stop check), `Verified` (verify -> accept: the verify result and the
target's features of the tree) and `Accepted` (accept -> capture: the verify rows kept). Must not
touch: models, drafting, verification, the engine's shared state (costs, calibrations, the suffix
index). Containers only: the engine's steps fill them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from adaptive_eagle.binding import HeadBinding
from adaptive_eagle.costmodel import PlainGate
from adaptive_eagle.drafting import HeadFeed
from adaptive_eagle.lookup import BudgetSplit
from adaptive_eagle.request import GenerationRequest
from adaptive_eagle.stopping import StopCheck
from adaptive_eagle.trace import SamplingParams, VerifyStep
from adaptive_eagle.verify import VerifyResult


@dataclass
class DecodeState:
    """A request in flight. Lives for one `run`; the engine's steps update it in place."""

    request: GenerationRequest
    binding: HeadBinding  # read once when the request starts: it drafts, calibrates and reports with this head
    prompt_ids: list[int]
    cache: Any  # the target's KV cache (transformers DynamicCache): every committed token but the newest
    need_aux: bool  # the target's aux features are needed (a head drafts, or hidden states are captured)
    feed: HeadFeed | None  # the head's KV cache and committed positions not yet fed (None: no head)
    stops: StopCheck  # where the output ends; stops.kept is the output so far
    t0: float  # perf_counter at the start of the prefill
    split: BudgetSplit = field(default_factory=BudgetSplit)
    plain_gate: PlainGate = field(default_factory=PlainGate)  # does speculating pay for this request (engine.py)
    # every committed token; a verify step may commit past the output's end, which stops.kept excludes
    generated: list[int] = field(default_factory=list)
    steps: list[VerifyStep] = field(default_factory=list)
    captured: list[torch.Tensor] = field(default_factory=list)  # [n, n_aux * H + H] rows per forward, on the CPU
    constraint: Any = None  # grammar.Constraint of a constrained request (its matcher), else None

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def root_pos(self) -> int:
        """Position of the tree's root: the newest committed token, not yet in the target's cache."""
        return len(self.prompt_ids) + len(self.generated) - 1

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.generated


@dataclass(frozen=True)
class Verified:
    """The verify step's hand-off: the tree checked in one target forward."""

    result: VerifyResult
    aux: torch.Tensor | None  # [tree.size + 1, n_aux * H] the target's aux features per verify row (None: not needed)
    final: torch.Tensor | None  # [tree.size + 1, H] final-norm hidden per verify row (None: no capture)
    t_verify: float  # perf_counter when the verify forward started
    t_done: float  # clock when it finished (0.0 when the step is not timed)


@dataclass(frozen=True)
class Accepted:
    """The accept step's hand-off: what the target's cache and the head keep."""

    rows: torch.Tensor  # [1 + accepted drafts] verify rows on the accepted path (0 = the root)
    tokens: tuple[int, ...]  # the step's committed tokens: accepted drafts + the bonus token
