"""Per-rank routing on pushed KV events over HTTP: two colocated replicas of DP=2 (four ranks,
each a cache location `{replica}/dp{rank}`) on the session's Ray, the session's private Redis as
the index and the event stream, no store: a prompt's blocks are reused only from the memory of the
rank that computed them. The memory leases in the prefix index are deleted before the repeats, so
only the ranks' KV events can tell the ingress where each prefix is; every repeat must still land
on the rank that holds it (the replica by the ingress's router, the rank by the replica).
"""
from __future__ import annotations

import time

import httpx
import pytest
from ray import serve

from tests.helpers import BLOCK_TOKENS, random_prompt, write_tiny_checkpoint
from tests.integration.chaos_cluster import forget_leases, scrape
from tests.local_serve import small_config

pytestmark = pytest.mark.slow     # a Serve app of two replicas, each with a gloo rank actor

NAME = "swa_csa_hca"
BT = BLOCK_TOKENS[NAME]
DP2 = {"data_parallel_size": 2, "enable_expert_parallel": True, "num_cpus": 0.25, "num_replicas": 2}
EVENTS_WAIT_S = 60.0    # publishers beat every second; under CI's load the router may lag several


@pytest.fixture(scope="module")
def url(tmp_path_factory, redis_server, local_serve):
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp(NAME), NAME)
    engine = {"model": str(checkpoint), "block_tokens": BT, "kv_cache_bytes": "8MiB", "index": redis_server}
    return local_serve.deploy("kvev", small_config("colocated", engine=engine, colocated=DP2,
                                                   ingress={"token_timeout_s": 30.0}), "/kvev")


def complete(url: str, prompt: list[int], max_tokens: int = 4) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def per_rank(url: str, name: str, **match) -> dict[tuple[str, str], float]:
    """(worker, rank) -> kvmesh_rank_<name>, over every replica."""
    return {(dict(labels)["worker"], dict(labels)["rank"]): v for (metric, labels), v in scrape(url).items()
            if metric == f"kvmesh_rank_{name}" and all(dict(labels).get(k) == w for k, w in match.items())}


def wait_for_events(url: str, device_blocks: int) -> None:
    """Until the ingress's event index knows all four ranks, none of them resyncing, and at least
    `device_blocks` blocks in device memory: what it must know before routing on events alone is
    checked (a fixed sleep was too short at CI's load: the repeat went by load, a miss)."""
    deadline, seen = time.monotonic() + EVENTS_WAIT_S, {}
    while time.monotonic() < deadline:
        m = scrape(url)
        seen = {"publishers": m.get(("kvmesh_kv_event_publishers", ())),
                "resyncing": m.get(("kvmesh_kv_event_resyncing", ())),
                "device": m.get(("kvmesh_kv_event_blocks", (("tier", "device"),)), 0)}
        if seen["publishers"] == 4 and seen["resyncing"] == 0 and seen["device"] >= device_blocks:
            return
        time.sleep(0.25)
    raise AssertionError(f"the ingress's event index did not catch up in {EVENTS_WAIT_S:.0f} s: {seen}")


def test_a_repeat_goes_to_the_rank_that_holds_it_across_dp_replicas_from_events_alone(url, redis_server):
    complete(url, random_prompt(BT + 1, seed=200))        # the ingress starts following the events
    wait_for_events(url, 1)
    prompts = [random_prompt(4 * BT + 3, seed=201 + i) for i in range(4)]
    holder = {}
    for i, prompt in enumerate(prompts):
        before = per_rank(url, "prompt_tokens")
        assert complete(url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        took = [k for k, v in per_rank(url, "prompt_tokens").items() if v - before.get(k, 0) == len(prompt)]
        assert len(took) == 1, took
        holder[i] = took[0]
    info = serve.get_deployment_handle("Colocated", "kvev").info.remote().result()
    assert forget_leases(redis_server, info["index_namespace"]) > 0
    wait_for_events(url, 1 + 4 * len(prompts))
    for i, prompt in enumerate(prompts):
        hits = per_rank(url, "prefix_hit_tokens", tier="device")
        again = complete(url, prompt)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BT
        gained = {k: v - hits.get(k, 0) for k, v in per_rank(url, "prefix_hit_tokens", tier="device").items()}
        assert gained[holder[i]] == 4 * BT and all(v == 0 for k, v in gained.items() if k != holder[i]), gained
    m = scrape(url)
    assert m[("kvmesh_route_hints_total", (("source", "events"),))] >= len(prompts)
    assert m[("kvmesh_kv_event_publishers", ())] == 4                  # 2 replicas x 2 ranks
