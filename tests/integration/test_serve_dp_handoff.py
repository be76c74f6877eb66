"""Disaggregated serving with data-parallel pools over HTTP: prefill DP=2+EP -> decode DP=2+EP,
and prefill DP=2+EP -> decode TP=1. Each replica is the Serve replica (rank 0) plus a rank
actor in its placement group; every rank registers its own cache with its own NIXL agent, so a
handoff READs from the holding prefill rank straight into the decode rank's memory. Concurrent
prompts spread over the ranks (a held cache counts as load); every answer equals the offline
engine (tokens, logprobs within 1e-4); once read, every prefill rank has freed its held caches.

The session's Ray, one Serve app per configuration (two apps)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import BLOCK_TOKENS, assert_same_run, random_prompt, tiny_engine, write_tiny_checkpoint
from tests.integration.chaos_cluster import scrape
from tests.local_serve import small_config
from kvmesh.workers.sampling.params import SamplingParams

pytestmark = pytest.mark.slow     # a Ray cluster, Serve apps with gloo rank actors

NAME = "swa_csa_hca"
BT = BLOCK_TOKENS[NAME]
DP2 = {"data_parallel_size": 2, "enable_expert_parallel": True, "num_cpus": 0.25}
APPS = {"dpdp": DP2, "dptp": {}}          # app -> its decode pool (prefill: DP2 in both)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(the tiny checkpoint, the cold single-process engine on it: the reference for every answer)."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(NAME), NAME)
    offline = tiny_engine(path, NAME)
    yield path, offline
    offline.close()


@pytest.fixture(scope="module")
def urls(model, local_serve):
    engine = {"model": str(model[0]), "block_tokens": BT, "kv_cache_bytes": "8MiB"}
    return local_serve.deploy_many({app: (small_config(engine=engine, prefill=DP2, decode=decode,
                                                       ingress={"token_timeout_s": 30.0}), f"/{app}")
                                    for app, decode in APPS.items()})


def complete(url: str, prompt: list[int]) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
        "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def per_rank(url: str, name: str, pool: str) -> dict[str, float]:
    return {dict(labels)["rank"]: v for (metric, labels), v in scrape(url).items()
            if metric == f"kvmesh_rank_{name}" and dict(labels)["pool"] == pool}


def worker(url: str, name: str, pool: str) -> float:
    return sum(v for (metric, labels), v in scrape(url).items()
               if metric == f"kvmesh_worker_{name}" and dict(labels)["pool"] == pool)


@pytest.mark.parametrize("app", sorted(APPS))
def test_concurrent_handoffs_from_dp_prefill_ranks_equal_the_offline_engine(urls, model, app):
    url, offline = urls[app], model[1]
    prompts = [random_prompt(n * BT + 3, seed=10 * n + len(app)) for n in (3, 5, 7, 8, 4, 6)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: complete(url, p), prompts))
    for prompt, choice in zip(prompts, answers):
        ref = offline.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0]
        assert_same_run(ref, choice["token_ids"], choice["logprobs"]["token_logprobs"], tol=1e-4)
    took = per_rank(url, "prompt_tokens", "prefill")
    assert len(took) == 2 and all(took.values()), took                    # both prefill ranks held caches
    if app == "dpdp":
        loaded = per_rank(url, "prompt_tokens", "decode")
        assert len(loaded) == 2 and all(loaded.values()), loaded          # both decode ranks loaded some
    assert worker(url, "nixl_bytes", "decode") > 0 and worker(url, "fallbacks", "decode") == 0
    deadline = time.monotonic() + 10
    while any(per_rank(url, "held", "prefill").values()) and time.monotonic() < deadline:
        time.sleep(0.2)                                                  # the release loop polls every rank
    assert not any(per_rank(url, "held", "prefill").values())
    assert worker(url, "held_timeouts", "prefill") == 0
