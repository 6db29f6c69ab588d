"""bench/cluster.py's pure parts: the argument checks, the summary of a run's requests (what counts as in flight
on the lost node, refused while it was down, hung, and when it recovered), where each replica runs, and the
gateway counters it reads. The run itself (`ray up` on ops/local-cluster.yaml) is a bench, not part of make
test."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.cluster import Request, check_args, metric_by_replica, place, replica_back, summarize, table


def args(**kw) -> argparse.Namespace:
    base = dict(restart="autoscaler", clients=3, before_s=45.0, down_s=20.0, after_s=30.0, request_timeout_s=90.0, ready_timeout_s=900.0,
                down_wait_s=60.0, max_tokens=16)
    return argparse.Namespace(**{**base, **kw})


def test_check_args_accepts_the_quick_settings_and_refuses_what_cannot_work():
    assert check_args(args()).clients == 3
    for bad, says in ((dict(clients=0), "--clients"), (dict(down_s=0), "--down-s"),
                      (dict(request_timeout_s=60), "serving.request_timeout_s"), (dict(max_tokens=65), "max_tokens_limit")):
        with pytest.raises(SystemExit, match=says):
            check_args(args(**bad))


def test_summary_splits_failures_by_when_they_happened_and_times_recovery_from_the_loss():
    t_loss = 100.0
    reqs = [Request(0, 90, 95, True, "ok"),
            Request(1, 98, 101, False, "5xx:503"),      # in flight when the node was lost
            Request(2, 102, 103, False, "5xx:503"),     # sent while the node was down
            Request(0, 99, 189, False, "hung"),         # in flight, reached the client timeout
            Request(1, 131, 140, True, "ok"),           # first answer after the loss: recovered 40 s after it
            Request(2, 133, 145, True, "ok"),
            Request(1, 150, 151, False, "connection")]  # later, unrelated to the node loss
    s = summarize(reqs, t_loss)
    assert (s["requests"], s["ok_requests"], s["failed_requests"], s["hung_requests"]) == (7, 3, 4, 1)
    assert s["failed_in_flight_on_lost_node"] == 2 and s["failed_while_node_down"] == 1 and s["failed_other"] == 1
    assert s["failed_beyond_in_flight"] == 2 and s["first_answer_after_loss_s"] == 40.0
    assert s["failed_by_kind"] == {"5xx:503": 2, "connection": 1, "hung": 1}
    assert s["node_loss_recovered_s"] == 40.0 and s["restart_to_recovered_s"] is None
    assert s["latency_p50_s"] == 9.0 and s["latency_max_s"] == 12.0
    assert "node_loss_recovered_s" in table(s) and json.loads(json.dumps(s)) == s
    restarted = summarize(reqs, t_loss, t_restart=132.0)  # the bench restarted the node at 132
    assert restarted["node_loss_recovered_s"] == 45.0 and restarted["restart_to_recovered_s"] == 13.0


def test_a_request_sent_while_the_node_was_being_stopped_was_in_flight_on_it():
    """node.sh stop takes seconds (SIGTERM, a wait, SIGKILL): a request routed to the lost replica during it
    started before its node was gone and failed in flight, not while the node was down."""
    reqs = [Request(0, 100.4, 102.8, False, "5xx:503"), Request(1, 104, 105, False, "5xx:503")]
    s = summarize(reqs, 100.0, t_recovered=150.0, t_stopped=103.1)
    assert s["failed_in_flight_on_lost_node"] == 1 and s["failed_while_node_down"] == 1
    assert summarize(reqs, 100.0, t_recovered=150.0)["failed_in_flight_on_lost_node"] == 0  # the stop as an instant


def test_summary_of_a_run_that_never_recovered_says_so():
    s = summarize([Request(0, 1, 2, True, "ok"), Request(0, 11, 12, False, "5xx:503")], 10.0)
    assert s["node_loss_recovered_s"] is None and s["failed_while_node_down"] == 1


def test_two_replicas_the_node_is_back_when_its_replica_serves_again_not_at_the_first_answer():
    """With two replicas the other one answers right after the loss; the lost node is back when its own replica
    serves again (`t_recovered`, seen by the bench), and only the requests in flight on it failed."""
    t_loss = 100.0
    reqs = [Request(0, 98, 101, False, "5xx:503"),  # in flight on the lost node's replica
            Request(1, 99, 102, True, "ok"),        # in flight on the other replica
            Request(0, 102, 104, True, "ok"),       # sent while the node was down: the other replica (or a retry)
            Request(2, 103, 106, True, "ok"),
            Request(1, 150, 152, True, "ok")]
    s = summarize(reqs, t_loss, t_recovered=141.5)
    assert s["failed_requests"] == 1 and s["failed_in_flight_on_lost_node"] == 1 and s["failed_beyond_in_flight"] == 0
    assert s["failed_while_node_down"] == 0 and s["hung_requests"] == 0
    assert s["node_loss_recovered_s"] == 41.5 and s["first_answer_after_loss_s"] == 4.0
    late = summarize([*reqs, Request(2, 120, 121, False, "5xx:503")], t_loss, t_recovered=141.5)
    assert late["failed_while_node_down"] == 1 and late["failed_beyond_in_flight"] == 1  # before 141.5: while down


def test_replicas_are_placed_by_their_process_in_rays_actor_table():
    rows = [["ServerActor", "127.0.0.4", 202], ["TrainerActor", "127.0.0.2", 300], ["ServerActor", "127.0.0.3", 201]]
    statuses = [{"replica": "replica-1", "pid": 202}, {"replica": "replica-0", "pid": 201}]
    where = place(rows, statuses)
    assert where.actors == {"ServerActor": ["127.0.0.3", "127.0.0.4"], "TrainerActor": ["127.0.0.2"]}
    assert where.replicas == {"replica-0": "127.0.0.3", "replica-1": "127.0.0.4"}
    assert place(rows, [{"replica": "replica-0", "pid": 999}]).replicas == {"replica-0": "unknown"}


def test_a_replica_is_back_from_a_new_process_that_has_served():
    old = {"replica": "replica-0", "pid": 201, "served": 40}
    assert not replica_back([old, {"replica": "replica-1", "pid": 202, "served": 9}], "replica-0", 201)
    assert not replica_back([{"replica": "replica-0", "pid": 301, "served": 0}], "replica-0", 201)  # loaded, idle
    assert replica_back([{"replica": "replica-0", "pid": 301, "served": 1}], "replica-0", 201)
    assert not replica_back([], "replica-0", 201)  # its node is gone: it does not answer


def test_gateway_counters_are_read_per_replica():
    text = ("# HELP ae_replica_failures_total Requests whose replica failed\n"
            "# TYPE ae_replica_failures_total counter\n"
            'ae_replica_failures_total{replica="replica-0"} 5.0\n'
            'ae_replica_failures_created{replica="replica-0"} 1.7e9\n'
            'ae_replica_restarts_total{replica="replica-0"} 1.0\n')
    assert metric_by_replica(text, "ae_replica_failures_total") == {"replica-0": 5.0}
    assert metric_by_replica(text, "ae_replica_restarts_total") == {"replica-0": 1.0}
    assert metric_by_replica(text, "ae_replica_up") == {}
