"""Data-parallel replicas on Ray Serve: a colocated replica of DP=2 + expert parallelism is the
Serve replica (rank 0, the front) plus one rank actor (a whole attention engine with half the
routed experts) in the replica's own placement group.

One Serve app for the module on the session's Ray, a tiny SWA + CSA + HCA checkpoint (4 routed
experts), the session's private Redis as the prefix index (each rank a cache location of its
own, `{replica}/dp{rank}`), no store: a prompt's blocks are reused only from the memory of the
rank that computed them, so `cached_tokens` says which rank a request went to. Which rank ran
what is read from /metrics (`kvmesh_rank_*{rank}`).
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray
from ray import serve
from ray.util.placement_group import placement_group_table

from kvmesh.cluster.serve.locator import PrefixLocator
from tests.helpers import (BLOCK_TOKENS, assert_clean_end, assert_same_run, random_prompt, sse_events, stream_and_kill,
                           tiny_engine, write_tiny_checkpoint)
from tests.integration.chaos_cluster import scrape
from tests.local_serve import small_config
from kvmesh.workers.sampling.params import SamplingParams

pytestmark = pytest.mark.slow     # a Ray cluster, a Serve app with a gloo rank actor

NAME = "swa_csa_hca"
BT = BLOCK_TOKENS[NAME]
DP2 = {"data_parallel_size": 2, "enable_expert_parallel": True, "num_cpus": 0.25}
KILL_BOUND_S = 90.0          # the client hears the end of its stream within this
RECOVER_BOUND_S = 120.0      # the pool serves again within this after a rank died
LONG = 160                   # tokens of a request that must still run while another arrives


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp(NAME), NAME)


@pytest.fixture(scope="module")
def offline(checkpoint):
    """The cold single-process engine: the reference for every answer."""
    engine = tiny_engine(checkpoint, NAME)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(checkpoint, redis_server, local_serve):
    engine = {"model": str(checkpoint), "block_tokens": BT, "kv_cache_bytes": "8MiB", "index": redis_server}
    return local_serve.deploy("dp", small_config("colocated", engine=engine, colocated=DP2,
                                                 ingress={"token_timeout_s": 20.0}), "/")


def complete(url: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
        **extra})
    assert r.status_code == 200, r.text
    return r.json()


def greedy(offline, prompt: list[int], max_tokens: int):
    return offline.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]


def per_rank(url: str, name: str, **match) -> dict[str, float]:
    """rank -> kvmesh_rank_<name> of the live replica (one replica in this module)."""
    return {dict(labels)["rank"]: v for (metric, labels), v in scrape(url).items()
            if metric == f"kvmesh_rank_{name}" and all(dict(labels).get(k) == w for k, w in match.items())}


def replica_ids() -> set[str]:
    prefix = "SERVE_REPLICA::dp#Colocated#"
    return {a["name"].removeprefix(prefix) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def replaced(victim: str, start: float) -> str:
    """The replica Serve started in place of `victim` once it runs alone (placement group, ranks and all)."""
    while time.monotonic() - start < RECOVER_BOUND_S:
        live = replica_ids()
        if victim not in live and len(live) == 1 and \
                serve.status().applications["dp"].deployments["Colocated"].status == "HEALTHY":
            if victim:
                print(f"colocated DP=2 replica replaced after {time.monotonic() - start:.1f}s: {live}")
            return live.pop()
        time.sleep(0.5)
    raise AssertionError(f"Serve did not replace the replica {victim} whose rank died: {replica_ids()}")


def rank1(replica: str) -> tuple[str, str]:
    """(name, namespace) of `replica`'s rank-1 actor."""
    name = f"kvmesh-rank:colocated:{replica}:1"
    (actor,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == name]
    return name, actor["namespace"]


def test_dp2_over_http_equals_the_offline_engine_tokens_and_logprobs(url, offline):
    for n in (5, 70, 9 * BT + 3):                                   # within a block, across many
        prompt = random_prompt(n, seed=n)
        choice = complete(url, prompt, 12, logprobs=0)["choices"][0]
        assert_same_run(greedy(offline, prompt, 12), choice["token_ids"], choice["logprobs"]["token_logprobs"],
                        tol=1e-4)


def test_each_dp2_replica_packs_its_ranks_in_one_placement_group(url):
    (replica,) = replica_ids()
    ranks = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("kvmesh-rank:colocated:")]
    assert ranks == [f"kvmesh-rank:colocated:{replica}:1"]
    groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"
              and g["strategy"] == "STRICT_PACK" and len(g["bundles"]) == 2]
    assert len(groups) == 1 and all(b == {"CPU": 0.25} for b in groups[0]["bundles"].values())


def test_concurrent_prompts_take_different_ranks_and_a_repeat_goes_to_the_rank_that_holds_it(url, offline, redis_server):
    prompts = [random_prompt(6 * BT + 1, seed=101), random_prompt(7 * BT + 5, seed=102)]   # lengths tell them apart
    lengths = (LONG, 40)
    before = per_rank(url, "prompt_tokens")
    started, streamed = threading.Event(), []

    def stream_first():             # still running (LONG tokens) when the second prompt arrives
        body = {"prompt": prompts[0], "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for event in sse_events(r.iter_lines()):
                if event != "[DONE]" and event["choices"]:
                    streamed.extend(event["choices"][0]["token_ids"])
                    started.set()
    first = threading.Thread(target=stream_first)
    first.start()
    assert started.wait(60)
    answers = [None, complete(url, prompts[1], lengths[1])]
    first.join()
    answers[0] = {"choices": [{"token_ids": streamed}]}
    took = {r: v - before.get(r, 0) for r, v in per_rank(url, "prompt_tokens").items()}
    assert sorted(took.values()) == sorted(map(len, prompts)), took          # one prompt on each rank
    for prompt, answer, n in zip(prompts, answers, lengths):
        assert answer["choices"][0]["token_ids"] == greedy(offline, prompt, n).token_ids
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    info = serve.get_deployment_handle("Colocated", "dp").info.remote().result()
    locator = PrefixLocator(redis_server)          # what the ingress reads: each rank a location of its own
    locator.configure(info["fingerprint"], BT, info["index_namespace"])
    for prompt, answer in zip(prompts, answers):      # idle ranks: a tie would go to rank 0 for both
        rank = next(r for r, n in took.items() if n == len(prompt))
        want, deadline = {f"{info['worker_id']}/dp{rank}": len(prompt) // BT}, time.monotonic() + 10
        while (got := locator.hint(prompt).prefix_blocks) != want and time.monotonic() < deadline:
            time.sleep(0.2)     # a new locator follows the KV events: heard from, then synced by a snapshot
        assert got == want
        hits = per_rank(url, "prefix_hit_tokens", tier="device")
        again = complete(url, prompt, 40)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 6 * BT
        assert again["choices"][0]["token_ids"] == answer["choices"][0]["token_ids"][:40]
        gained = {r: v - hits.get(r, 0) for r, v in per_rank(url, "prefix_hit_tokens", tier="device").items()}
        assert gained[rank] >= 6 * BT and all(v == 0 for r, v in gained.items() if r != rank), gained
    locator.close()


def test_n2_forks_stay_on_one_rank(url, offline):
    prompt = random_prompt(3 * BT + 2, seed=103)
    before = per_rank(url, "generated_tokens")
    body = complete(url, prompt, 8, n=2)
    want = greedy(offline, prompt, 8).token_ids
    assert [c["token_ids"] for c in body["choices"]] == [want, want]
    made = sorted(v - before.get(r, 0) for r, v in per_rank(url, "generated_tokens").items())
    assert made == [0, 16], made


def test_replica_metrics_sum_the_ranks(url):
    m = scrape(url)
    ranks = sum(v for (name, labels), v in m.items() if name == "kvmesh_rank_prompt_tokens")
    (replica,) = [v for (name, labels), v in m.items() if name == "kvmesh_worker_prompt_tokens"]
    assert replica == ranks > 0


@pytest.mark.slow
def test_a_rank_actor_killed_mid_stream_ends_cleanly_and_serve_replaces_the_replica(url, offline):
    prompt = random_prompt(20, seed=3)
    want = greedy(offline, prompt, 300).token_ids
    (victim,) = replica_ids()
    name, namespace = rank1(victim)
    body = {"prompt": prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    start = time.monotonic()
    tokens, errors, _ = stream_and_kill(
        url, body, lambda: ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True), KILL_BOUND_S)
    assert len(tokens) < len(want) or tokens == want
    assert_clean_end(tokens, errors, want)
    replaced(victim, start)
    assert complete(url, prompt, 8)["choices"][0]["token_ids"] == want[:8]


@pytest.mark.slow
def test_a_rank_that_dies_while_idle_fails_the_health_check_and_the_replica_is_replaced(url, offline):
    victim = replaced("", time.monotonic())          # the replica the test above left running
    name, namespace = rank1(victim)
    start = time.monotonic()
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    replaced(victim, start)
    prompt = random_prompt(30, seed=7)
    assert complete(url, prompt, 8)["choices"][0]["token_ids"] == greedy(offline, prompt, 8).token_ids
