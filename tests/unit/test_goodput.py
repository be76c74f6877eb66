"""bench/goodput.py's arithmetic: a request is good only when it succeeded within both targets
(ITL as its p90 gap), replicas come from /metrics' `kvmesh_pool_replicas` in every state that
holds resources, and replica-seconds integrate the polls over the run."""
from __future__ import annotations

import pytest

from bench.goodput import Outcome, replica_seconds, replicas_by_pool


def test_good_needs_success_and_both_targets():
    fast = Outcome(0.0, 10, 4, ttft_s=0.5, gaps=[0.01] * 9 + [0.5], ended=1.0, tokens=4)
    assert fast.itl_s == pytest.approx(0.01)            # p90 of ten gaps: one slow gap is forgiven
    assert fast.good(1.0, 0.05) and not fast.good(0.4, 0.05)
    slow = Outcome(0.0, 10, 4, ttft_s=0.5, gaps=[0.01] * 8 + [0.5, 0.5], ended=1.0, tokens=4)
    assert not slow.good(1.0, 0.05)
    assert Outcome(0.0, 10, 1, ttft_s=0.5, ended=1.0, tokens=1).good(1.0, 0.0)      # one token: no gap
    assert not Outcome(0.0, 10, 4, ttft_s=0.1, ended=1.0, error="HTTP 503").good(1.0, 1.0)


def test_replicas_by_pool_counts_every_state_that_holds_resources():
    text = "\n".join(['kvmesh_pool_replicas{pool="prefill",state="RUNNING"} 2.0',
                      'kvmesh_pool_replicas{pool="prefill",state="STARTING"} 1.0',
                      'kvmesh_pool_replicas{pool="decode",state="RUNNING"} 1.0',
                      'kvmesh_pool_replicas{pool="decode",state="PENDING_MIGRATION"} 1.0',
                      'kvmesh_worker_free_blocks{pool="decode",worker="x"} 7.0'])
    assert replicas_by_pool(text) == {"prefill": 3, "decode": 1}


def test_replica_seconds_integrate_the_polls_over_the_run():
    polls = [(1.0, {"prefill": 1, "decode": 1}), (3.0, {"prefill": 2, "decode": 1}), (5.0, {"prefill": 1})]
    # [0, 1): as the first poll saw it (2); [1, 3): 2; [3, 5): 3; [5, 6): 1
    assert replica_seconds(polls, 0.0, 6.0) == pytest.approx(2 + 4 + 6 + 1)
    assert replica_seconds(polls, 2.0, 4.0) == pytest.approx(2 + 3)
