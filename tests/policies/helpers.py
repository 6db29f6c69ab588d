"""Sample builders shared by the policy tests: per-request accept lengths drawn from simple, seeded
distributions (1 + lognormal: a long upper tail, a floor at 1 like real accept lengths)."""

from __future__ import annotations

import numpy as np

from policies.config import PolicyConfig
from policies.samples import RequestSample


def accept_lengths(rng: np.random.Generator, n: int, *, shift: float = 0.0, spread: float = 0.5,
                   difficulty: np.ndarray | None = None, noise: float = 0.0) -> np.ndarray:
    """1 + exp(latent): latent ~ N(shift, spread) or, for paired records, difficulty + N(0, noise)."""
    latent = rng.normal(shift, spread, n) if difficulty is None else difficulty + shift + rng.normal(0, noise, n)
    return 1.0 + np.exp(latent)


def samples(values, version: str, *, domain: str | None = None, ids: str = "r", start: int = 0,
            tpot: np.ndarray | None = None, finished_at: float = 0.0) -> list[RequestSample]:
    return [RequestSample(accept_length=float(max(v, 1.0)), head_version=version, domain=domain,
                          request_id=f"{ids}{start + i}", tpot_s=None if tpot is None else float(tpot[i]),
                          finished_at=finished_at) for i, v in enumerate(values)]


def small_config(**kw) -> PolicyConfig:
    """Defaults with fewer resamples (fast tests); any field can be overridden."""
    return PolicyConfig(**{"bootstrap_resamples": 1000, **kw})


def replay(champion_shift: float, candidate_shift: float, n: int = 300, champion="v1", candidate="v2"):
    """Acceptance replay: both heads scored on the same n records (paired by request_id)."""
    rng = np.random.default_rng(7)
    d = rng.normal(0, 0.3, n)
    return (samples(accept_lengths(rng, n, difficulty=d + champion_shift, noise=0.1), champion),
            samples(accept_lengths(rng, n, difficulty=d + candidate_shift, noise=0.1), candidate))
