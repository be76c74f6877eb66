"""Choosing a replica (cluster/serve/routing.py): the longest in-memory prefix, then load, then
free KV memory; a data-parallel rank (`{replica}/dp{rank}`) is a cache location of its replica."""
from __future__ import annotations

from cluster.messages import RouteHint
from cluster.serve.routing import location, rank_hint, rank_replicas


def test_longest_in_memory_prefix_wins_then_load_then_free_kv():
    replicas = [("a", 0.5, 1.0), ("b", 0.0, 1.0), ("c", 0.0, 0.1)]
    assert rank_replicas(replicas, RouteHint(prefix_blocks={"a": 3, "c": 1}), 1.0) == ["a", "c", "b"]
    assert rank_replicas(replicas, RouteHint(), 1.0) == ["b", "a", "c"]      # c: little free KV
    assert rank_replicas(replicas, RouteHint(), 0.0)[-1] == "a"              # load alone


def test_a_data_parallel_rank_is_a_cache_location_of_its_replica():
    replicas = [("a", 0.0, 1.0), ("b", 0.0, 1.0)]
    hint = RouteHint(prefix_blocks={"a/dp0": 1, "b/dp1": 4, "b/dp0": 2})
    assert rank_replicas(replicas, hint, 1.0) == ["b", "a"]                  # b's best rank holds the most
    assert (rank_hint(hint, "b"), rank_hint(hint, "a"), rank_hint(hint, "c")) == (1, 0, None)
    assert rank_hint(RouteHint(prefix_blocks={"b/dp0": 3, "b/dp1": 3}), "b") is None   # a tie: the front decides
    assert rank_hint(RouteHint(prefix_blocks={"b": 3}), "b") is None         # not data-parallel
    assert location("x/y/dp12") == ("x/y", 12) and location("w") == ("w", None)
