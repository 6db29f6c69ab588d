"""policies.fleet: the Fleet protocol, as the tests' LocalFleet (tests/policies/fleets.py) implements it
over policies.canary: it swaps every replica, reports confirmed versions, routes a stable canary fraction,
and returns live samples by version and time."""

from __future__ import annotations

import pytest

from adaptive_eagle.versions import PLAIN
from policies.fleet import Fleet, SwapOutcome
from policies.samples import RequestSample
from tests.policies.fleets import LocalFleet
from tests.policies.replicas import Outcome, RecordingReplica


def test_swap_reaches_every_replica_and_versions_are_confirmed():
    replicas = [RecordingReplica(), RecordingReplica(), RecordingReplica(refuse={"v2"})]
    fleet = LocalFleet(replicas)
    assert isinstance(fleet, Fleet) and fleet.serving_versions() == [PLAIN] * 3
    results = fleet.swap("v2")
    assert [r.ok for r in results] == [True, True, False] and all(isinstance(r, SwapOutcome) for r in results)
    assert fleet.serving_versions() == ["v2", "v2", PLAIN]
    assert [r.swaps for r in replicas] == [["v2"]] * 3
    fleet.swap(PLAIN)
    assert fleet.serving_versions() == [PLAIN] * 3


def test_canary_routes_a_stable_fraction():
    fleet = LocalFleet([RecordingReplica("v1")])
    ids = [f"r{i}" for i in range(4000)]
    assert {fleet.route(i) for i in ids} == {"v1"}
    fleet.set_canary("v2", 0.25)
    routed = [fleet.route(i) for i in ids]
    share = routed.count("v2") / len(ids)
    assert abs(share - 0.25) < 0.03 and routed == [fleet.route(i) for i in ids]  # same id, same route
    fleet.set_canary(None, 0.0)
    assert fleet.canary is None and {fleet.route(i) for i in ids} == {"v1"}
    with pytest.raises(ValueError, match="fraction"):
        fleet.set_canary("v2", 1.5)


def test_live_samples_by_version_and_time():
    fleet = LocalFleet([RecordingReplica()], max_samples=5)
    for t, v in [(1.0, "v1"), (2.0, "v2"), (3.0, "v1"), (4.0, "v1")]:
        fleet.record(RequestSample(1.5, v, finished_at=t))
    assert [s.finished_at for s in fleet.live_samples("v1", since=2.0)] == [3.0, 4.0]
    assert fleet.live_samples("v3", since=0.0) == []
    for t in range(10, 14):
        fleet.record(RequestSample(1.5, "v1", finished_at=t))
    kept = [s.finished_at for s in fleet.live_samples("v1", since=0.0)]
    assert kept == [4.0, 10, 11, 12, 13]  # bounded at 5: the oldest fell off


def test_an_empty_fleet_is_refused():
    with pytest.raises(ValueError, match="at least one replica"):
        LocalFleet([])


def test_outcome_protocol_is_structural():
    assert isinstance(Outcome(True, "", "v1"), SwapOutcome)
