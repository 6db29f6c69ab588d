"""Test replicas and traffic for the fleet and controller tests: a replica is a small real object that
records its swaps and can refuse some versions; traffic routes requests through LocalFleet.route and
records one sample per finished request, with accept lengths drawn per head version."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from adaptive_eagle.versions import PLAIN
from policies.samples import RequestSample
from tests.policies.fleets import LocalFleet


@dataclass(frozen=True)
class Outcome:
    ok: bool
    message: str
    version: str | None


@dataclass
class RecordingReplica:
    """Serves one version; swap_head records every call and refuses the versions in `refuse`."""

    head_version: str | None = None
    refuse: set = field(default_factory=set)
    swaps: list = field(default_factory=list)

    def swap_head(self, version: str) -> Outcome:
        self.swaps.append(version)
        if version in self.refuse:
            return Outcome(False, f"head {version} failed validation; {self.head_version or 'none'} keeps serving",
                           self.head_version)
        self.head_version = None if version == PLAIN else version
        return Outcome(True, f"serving {version}", self.head_version)


class FakeClock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Traffic:
    """Requests through a LocalFleet. `quality[version]` is the latent shift of its accept lengths
    (1 + exp(N(shift, 0.3))); `speed[version]` its median seconds per output token. A version in
    `collapsed` accepts (almost) nothing."""

    fleet: LocalFleet
    clock: FakeClock
    quality: dict
    speed: dict = field(default_factory=dict)
    collapsed: set = field(default_factory=set)
    seed: int = 0
    served: int = 0

    def serve(self, n: int) -> None:
        rng = np.random.default_rng(self.seed + self.served)
        for _ in range(n):
            rid = f"q{self.served}"
            self.served += 1
            self.clock.t += 0.01
            version = self.fleet.route(rid)
            if version == PLAIN:
                accept = 1.0
            elif version in self.collapsed:
                accept = 1.0 + rng.uniform(0, 0.03)
            else:
                accept = 1.0 + float(np.exp(rng.normal(self.quality[version], 0.3)))
            tpot = self.speed.get(version, 0.04) * float(np.exp(rng.normal(0, 0.1)))
            self.fleet.record(RequestSample(accept, version, request_id=rid, tpot_s=tpot, finished_at=self.clock.t,
                                            tokens=64))
