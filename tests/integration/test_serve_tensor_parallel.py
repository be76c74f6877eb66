"""Tensor-parallel replicas on Ray Serve: a replica of N ranks is the Serve replica (rank 0)
plus N-1 rank actors in the replica's own placement group.

The session's Ray, a tiny checkpoint, two disaggregated apps: at `/` prefill
TP=2 hands off to decode TP=1, at `/back` prefill TP=1 hands off to decode TP=2 with expert
parallelism (the pool whose rank actor is killed mid-stream).
"""
from __future__ import annotations

import time

import httpx
import pytest
import ray
from ray import serve
from ray.util.placement_group import placement_group_table

from kvmesh.cluster.app import build_app
from kvmesh.cluster.config import ConfigFileError
from tests.helpers import BLOCK_TOKENS, assert_clean_end, random_prompt, stream_and_kill, write_tiny_checkpoint
from tests.local_serve import small_config
from kvmesh.workers.engine import Engine
from kvmesh.workers.sampling.params import SamplingParams

pytestmark = pytest.mark.slow     # a Ray cluster, Serve apps with gloo rank actors

NAME = "swa_csa_hca"
TP2 = {"tensor_parallel_size": 2, "num_cpus": 0.25}
TP2_EP = {**TP2, "enable_expert_parallel": True}
KILL_BOUND_S = 90.0          # the client hears the end of its stream within this
RECOVER_BOUND_S = 120.0      # the pool serves again within this after a rank died


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp(NAME), NAME)


def config(checkpoint, mode: str, **pools):
    engine = {"model": str(checkpoint), "block_tokens": BLOCK_TOKENS[NAME], "kv_cache_bytes": "8MiB"}
    return small_config(mode, engine=engine, ingress={"token_timeout_s": 20.0}, **pools)


@pytest.fixture(scope="module")
def urls(checkpoint, local_serve):
    urls = local_serve.deploy_many({"tp": (config(checkpoint, "disaggregated", prefill=TP2), "/"),
                                    "tp-back": (config(checkpoint, "disaggregated", decode=TP2_EP), "/back")})
    return {"disagg": urls["tp"], "back": urls["tp-back"]}


def offline(checkpoint, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = Engine(config(checkpoint, "colocated").engine.engine_config())
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


def complete(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def rank_actors(pool: str) -> list[dict]:
    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(f"kvmesh-rank:{pool}:")]


def replica_ids(app: str, deployment: str) -> set[str]:
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return {a["name"].removeprefix(prefix) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def test_tp2_prefill_and_tp1_decode_over_http_equal_the_offline_engine(urls, checkpoint):
    prompts = [random_prompt(n, seed=n) for n in (5, 37, 70)]        # within a block, across blocks
    want = offline(checkpoint, prompts, 12)
    assert [complete(urls["disagg"], p, 12) for p in prompts] == want


def test_tp1_prefill_and_tp2_expert_parallel_decode_over_http_equal_the_offline_engine(urls, checkpoint):
    prompts = [random_prompt(n, seed=n + 1) for n in (9, 40)]
    assert [complete(urls["back"], p, 12) for p in prompts] == offline(checkpoint, prompts, 12)


def test_each_tp2_replica_packs_its_ranks_in_one_placement_group(urls):
    (prefill,) = replica_ids("tp", "Prefill")
    assert [a["name"] for a in rank_actors("prefill")] == [f"kvmesh-rank:prefill:{prefill}:1"]
    groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"
              and len(g["bundles"]) == 2 and g["strategy"] == "STRICT_PACK"]
    assert len(groups) >= 2            # one per TP=2 replica: tp's prefill and tp-back's decode
    assert all(b == {"CPU": 0.25} for g in groups for b in g["bundles"].values())
    (decode,) = replica_ids("tp-back", "Decode")
    assert [a["name"] for a in rank_actors("decode")] == [f"kvmesh-rank:decode:{decode}:1"]   # TP=1 pools: none


@pytest.mark.slow
def test_rank_actor_killed_mid_request_ends_cleanly_and_the_pool_recovers(urls, checkpoint):
    prompt = random_prompt(20, seed=3)
    want = offline(checkpoint, [prompt], 300)[0]
    (victim_replica,) = replica_ids("tp-back", "Decode")
    (rank,) = [a for a in rank_actors("decode") if a["name"] == f"kvmesh-rank:decode:{victim_replica}:1"]
    body = {"prompt": prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    start = time.monotonic()
    tokens, errors, _ = stream_and_kill(
        urls["back"], body, lambda: ray.kill(ray.get_actor(rank["name"], namespace=rank["namespace"]),
                                             no_restart=True), KILL_BOUND_S)
    assert len(tokens) < len(want) or tokens == want
    assert_clean_end(tokens, errors, want)
    deadline = time.monotonic() + RECOVER_BOUND_S
    while time.monotonic() < deadline:         # Serve replaces the replica: new placement group, new ranks
        fresh = replica_ids("tp-back", "Decode") - {victim_replica}
        if fresh and serve.status().applications["tp-back"].deployments["Decode"].replica_states.get("RUNNING"):
            break
        time.sleep(0.5)
    print(f"decode replica replaced after {time.monotonic() - start:.1f}s: {fresh}")
    assert fresh, "Serve did not replace the replica whose rank died"
    assert complete(urls["back"], prompt, 8) == want[:8]


@pytest.mark.slow
def test_a_rank_that_dies_while_idle_fails_the_health_check_and_the_replica_is_replaced(urls, checkpoint):
    (victim_replica,) = replica_ids("tp", "Prefill")
    (rank,) = [a for a in rank_actors("prefill") if a["name"] == f"kvmesh-rank:prefill:{victim_replica}:1"]
    ray.kill(ray.get_actor(rank["name"], namespace=rank["namespace"]), no_restart=True)
    start, fresh = time.monotonic(), set()
    while time.monotonic() - start < RECOVER_BOUND_S and not fresh:
        fresh = replica_ids("tp", "Prefill") - {victim_replica}
        time.sleep(0.5)
    print(f"prefill replica replaced {time.monotonic() - start:.1f}s after its idle rank died")
    assert fresh, "a dead rank of an idle replica went unnoticed"
    prompt = random_prompt(30, seed=7)
    assert complete(urls["disagg"], prompt, 8) == offline(checkpoint, [prompt], 8)[0]


def test_a_size_that_does_not_divide_the_model_fails_before_deploying(urls, checkpoint):
    bad = config(checkpoint, "disaggregated", decode={"tensor_parallel_size": 3, "num_cpus": 0.25})
    with pytest.raises(ConfigFileError, match=r"decode\.tensor_parallel_size.*tensor_parallel_size=3.*"
                                              r"num_attention_heads=4"):
        build_app(bad)


def test_a_size_that_does_not_divide_the_model_fails_at_replica_start_up(urls, checkpoint, tmp_path):
    """Where the driver cannot read the checkpoint (here: it is not there yet when the app is
    built), the replica's engine refuses the size at start-up and the deploy fails with it."""
    late = tmp_path / "late"
    bad = config(late, "colocated", colocated={"tensor_parallel_size": 3, "num_cpus": 0.25})
    app = build_app(bad)
    late.symlink_to(checkpoint, target_is_directory=True)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Deploying application bad failed"):
        serve.run(app, name="bad", route_prefix="/bad")
    print(f"deploy failed after {time.monotonic() - start:.1f}s")
    status = serve.status().applications["bad"].deployments["Colocated"]
    assert status.status == "DEPLOY_FAILED"
    assert "tensor_parallel_size=3 does not divide num_attention_heads=4" in status.message
    serve.delete("bad")
