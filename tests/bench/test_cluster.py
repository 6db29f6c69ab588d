"""bench/cluster.py's pure parts: the argument checks and the summary of a run's requests (what counts as in
flight on the lost node, refused while it was down, hung, and when it recovered). The run itself (`ray up` on
ops/local-cluster.yaml) is a bench, not part of make test."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.cluster import Request, check_args, summarize, table


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
    assert s["failed_by_kind"] == {"5xx:503": 2, "connection": 1, "hung": 1}
    assert s["node_loss_recovered_s"] == 40.0 and s["restart_to_recovered_s"] is None
    assert s["latency_p50_s"] == 9.0 and s["latency_max_s"] == 12.0
    assert "node_loss_recovered_s" in table(s) and json.loads(json.dumps(s)) == s
    restarted = summarize(reqs, t_loss, t_restart=132.0)  # the bench restarted the node at 132
    assert restarted["node_loss_recovered_s"] == 45.0 and restarted["restart_to_recovered_s"] == 13.0


def test_summary_of_a_run_that_never_recovered_says_so():
    s = summarize([Request(0, 1, 2, True, "ok"), Request(0, 11, 12, False, "5xx:503")], 10.0)
    assert s["node_loss_recovered_s"] is None and s["failed_while_node_down"] == 1
