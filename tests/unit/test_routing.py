"""Choosing a replica (cluster/serve/routing.py): the longest in-memory prefix, then load, then
free KV memory; a data-parallel rank (`{replica}/dp{rank}`) is a cache location of its replica."""
from __future__ import annotations

from kvmesh.cluster.messages import RouteHint
from kvmesh.cluster.serve.routing import Candidate, best_rank, decode_hint, location, rank_cost, rank_hint, rank_replicas


def test_longest_in_memory_prefix_wins_then_load_then_free_kv():
    replicas = [Candidate("a", 0.5, 1.0), Candidate("b", 0.0, 1.0), Candidate("c", 0.0, 0.1)]
    assert rank_replicas(replicas, RouteHint(prefix_blocks={"a": 3, "c": 1}), 1.0) == ["a", "c", "b"]
    assert rank_replicas(replicas, RouteHint(), 1.0) == ["b", "a", "c"]      # c: little free KV
    assert rank_replicas(replicas, RouteHint(), 0.0)[-1] == "a"              # load alone


def test_a_data_parallel_rank_is_a_cache_location_of_its_replica():
    replicas = [Candidate("a", 0.0, 1.0, (0, 0)), Candidate("b", 0.0, 1.0, (0, 0))]
    hint = RouteHint(prefix_blocks={"a/dp0": 1, "b/dp1": 4, "b/dp0": 2})
    assert rank_replicas(replicas, hint, 1.0) == ["b", "a"]                  # b's best rank holds the most
    assert (rank_hint(hint, "b", 2), rank_hint(hint, "a", 2), rank_hint(hint, "c", 2)) == (1, 0, None)
    assert rank_hint(RouteHint(prefix_blocks={"b/dp0": 3, "b/dp1": 3}), "b", 2) is None   # a tie: the front decides
    assert rank_hint(RouteHint(prefix_blocks={"b": 3}), "b", 1) is None      # not data-parallel
    assert location("x/y/dp12") == ("x/y", 12) and location("w") == ("w", None)


def test_every_replica_and_rank_is_scored_by_its_best_rank_not_its_total():
    """Without pushed loads: a replica's best rank (longest prefix, then its routing-stats load)."""
    a = Candidate("a", 0.0, 1.0, (2, 0))            # rank 1 idle, holds nothing
    b = Candidate("b", 0.0, 1.0, (5, 5))
    hint = RouteHint(prefix_blocks={"a/dp0": 3, "b/dp1": 3})
    assert best_rank(a, hint) == (-3, 2.0) and best_rank(b, hint, room=5.0) == (-3, 1.0)
    assert rank_replicas([a, b], hint, 1.0) == ["a", "b"]
    miss = RouteHint()
    assert rank_replicas([a, b], miss, 0.0) == ["a", "b"]          # a miss: the least loaded rank anywhere


def test_with_pushed_loads_a_rank_costs_the_tokens_a_request_would_wait_for_and_compute():
    """Queued tokens plus the prompt blocks a rank lacks: a holder deep in work loses to an idle
    rank, so a prefix every request shares (a system prompt) cannot pull them all onto one rank."""
    a = Candidate("a", 0.0, 1.0, (0, 0))
    b = Candidate("b", 0.0, 1.0, (0, 0))
    hint = RouteHint(prefix_blocks={"a/dp0": 3, "b/dp1": 3}, prompt_blocks=4, block_tokens=16,
                     loads={"a/dp0": 900.0, "a/dp1": 0.0, "b/dp0": 50.0, "b/dp1": 10.0})
    assert rank_cost(hint, "a/dp0", 0) == 916 and rank_cost(hint, "b/dp1", 0) == 26
    assert best_rank(a, hint) == (64.0,) and best_rank(b, hint) == (26.0,)
    assert rank_replicas([a, b], hint, 1.0) == ["b", "a"]
    # inside the chosen replica the rank holding the prefix alone is named; loads are the front's
    # (live), not the pushed ones: a rank not heard from, or a tie, is the front's to decide
    assert (rank_hint(hint, "a", 2), rank_hint(hint, "b", 2)) == (0, 1)
    assert rank_hint(RouteHint(prompt_blocks=4, block_tokens=16, loads={"a/dp0": 1.0}), "a", 2) is None
    quiet = RouteHint(prefix_blocks={"c/dp0": 2}, prompt_blocks=2, block_tokens=16)
    assert rank_cost(quiet, "c/dp1", 3.0) == 3 * 16 + 2 * 16          # not heard from: its stats, a block each


def test_a_pd_repeat_is_routed_to_the_decode_rank_that_holds_its_prefix_unless_it_is_busier_than_that():
    """Decode replicas are scored like prefill's: the request's prefix hint (decode ranks publish
    their pools too) with the loads pushed since; a decode rank's cost is the KV it would read each
    step (its decoding contexts) plus the blocks the handoff would move to it."""
    prefix = RouteHint(prefix_blocks={"p": 4, "d1/dp1": 3, "d0/dp0": 1}, prompt_blocks=4, block_tokens=16,
                       loads={"d0/dp0": 0.0, "d0/dp1": 0.0, "d1/dp0": 0.0, "d1/dp1": 0.0})
    fresh = RouteHint(loads={"d0/dp0": 10.0, "d0/dp1": 0.0, "d1/dp0": 0.0, "d1/dp1": 20.0}, block_tokens=16)
    hint = decode_hint(prefix, fresh)
    assert hint.loads == fresh.loads and hint.prefix_blocks == prefix.prefix_blocks and hint.prompt_blocks == 4
    decode = [Candidate("d0", 0.0, 1.0, (0, 0)), Candidate("d1", 0.0, 1.0, (0, 0))]
    assert rank_replicas(decode, hint, 1.0) == ["d1", "d0"]                 # d1/dp1: 20 + 16 beats d0/dp0: 10 + 48
    assert rank_hint(hint, "d1", 2) == 1                                    # and its holding rank runs it
    busy = decode_hint(prefix, RouteHint(loads={**fresh.loads, "d1/dp1": 60.0}, block_tokens=16))
    assert rank_replicas(decode, busy, 1.0) == ["d0", "d1"]                 # 60 + 16 (or d1/dp0: 64) loses to 58
    assert decode_hint(prefix, RouteHint()) is prefix                       # no fresher loads: the prefix hint's
    assert decode_hint(RouteHint(prefix_blocks={"d0": 2}), fresh).loads == {}   # an index hint stays one

