"""The fleet as the policy sees it: a small protocol (swap every replica, read what each serves, set a
canary, read live samples).

Owns: the ``Fleet`` protocol the controller drives and ``SwapOutcome``, what one replica's swap returns.
Must not touch: how a replica decodes or installs a head (``serving``, ``engine.set_head``), torch, Ray,
the registry. The canary itself (its record, the per-request decision by the request id's hash, the sink
of live samples) lives in ``policies.canary``; the serving package's gateway-backed Fleet calls it, and
the tests' in-process ``LocalFleet`` (tests/policies/fleets.py) does too.

Vocabulary: a *replica* is one server; its *version* is the head version it confirms it serves ("none":
plain decoding). A *canary* sends a fraction of new requests to a candidate version while the rest keep
the fleet's version (by routing requests, or by swapping some replicas: then ``serving_versions`` is mixed
during the canary); outside a canary every replica serves the same version.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from policies.samples import RequestSample


@runtime_checkable
class SwapOutcome(Protocol):
    """What one replica's ``swap_head`` returned (``adaptive_eagle.binding.SwapResult`` has these)."""

    ok: bool  # the replica serves `version` now; False: it refused and keeps its old head
    message: str  # why, when refused
    version: str | None  # the version the replica serves after the call (None or "none": plain decoding)


@runtime_checkable
class Fleet(Protocol):
    """Every replica of one model, as the policy drives it."""

    def swap(self, version: str) -> list[SwapOutcome]:
        """Hot-swap every replica to `version` ("none": plain decoding); one outcome per replica, in replica
        order. A refused swap leaves that replica on its old head. Never raises for a refusal."""
        ...

    def serving_versions(self) -> list[str]:
        """Each replica's confirmed version, in replica order ("none" for plain decoding)."""
        ...

    def set_canary(self, version: str | None, fraction: float) -> object:
        """Send `fraction` of new requests to `version` (None: end the canary; fraction is then ignored).
        A fleet may route per request (``policies.canary.Canary.takes``) or swap some replicas to `version`
        (the gateway's); the return value is ignored. Raises (ValueError, RuntimeError, ...) when the canary
        cannot be set."""
        ...

    def live_samples(self, version: str, since: float) -> list[RequestSample]:
        """Finished requests that decoded with `version` and finished at or after `since` (unix seconds)."""
        ...

    def cannot_serve(self, version: str) -> str | None:
        """Why some replica could never serve `version` (a head kind its engine cannot load: a MoE-routed head
        on SGLang replicas), or None. Cheap and side-effect free: the policy asks before judging a candidate,
        so a head the fleet cannot serve is refused with this reason instead of failing at its canary."""
        ...


__all__ = ["Fleet", "SwapOutcome"]
