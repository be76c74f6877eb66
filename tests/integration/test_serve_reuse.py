"""Cross-node prefix reuse on a two-node Ray test cluster: the session's (a
ray.cluster_utils.Cluster, tests/integration/conftest.py) and a node added for the module.

One prefill replica per node (each node carries one `kvmesh_prefill`), a shared store
folder and a private Redis prefix index. A prompt computed on node A is
  * routed back to A when repeated (the ingress reads A's memory lease in the index), and
  * restored on node B from the store A wrote, then decoded — same greedy tokens as cold.
"""
from __future__ import annotations

import time

import httpx
import pytest
import ray
from ray import serve

from kvmesh.cluster.messages import GenRequest, RouteHint
from kvmesh.kvstore.hashing import PrefixHasher
from kvmesh.kvstore.index.embedded import make_index
from tests.local_serve import small_config
from kvmesh.workers.engine import Engine
from kvmesh.workers.sampling.params import SamplingParams

BLOCK = 128
PROMPT = [3 + (i * 7919) % 256 for i in range(3 * BLOCK + 40)]     # three full blocks and a tail
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def two_nodes(redis_server, tmp_path_factory, local_serve, session_cluster):
    """The session's Ray (its head carries one kvmesh_prefill) and a second node for the module."""
    node = session_cluster.add_node(num_cpus=2, resources={"kvmesh_prefill": 1})
    try:
        config = small_config(
            "disaggregated",
            engine={"store": str(tmp_path_factory.mktemp("store")), "index": redis_server,
                    "kv_cache_bytes": 32 << 20},
            prefill={"num_replicas": 2, "resources": {"kvmesh_prefill": 1}})
        yield local_serve.deploy("reuse", config, "/"), config
    finally:
        try:
            local_serve.delete_all()        # before its node goes: no replica is restarted
        finally:
            session_cluster.remove_node(node)


def prefill_workers() -> list[str]:
    prefix = "SERVE_REPLICA::reuse#Prefill#"
    return [a["name"].removeprefix(prefix) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)]


def info(worker: str) -> dict:
    return serve.get_deployment_handle("Prefill", "reuse").info.remote(hint=RouteHint(require_worker=worker)).result()


def complete(url: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def worker_counter(metrics: str, name: str, worker: str) -> float:
    prefix = f'kvmesh_worker_{name}{{pool="prefill",worker="{worker}"}} '
    return sum(float(l.split()[-1]) for l in metrics.splitlines() if l.startswith(prefix))


@pytest.mark.slow
def test_prefix_computed_on_one_node_is_reused_on_the_other(two_nodes):
    url, config = two_nodes
    cold = Engine(small_config().engine.engine_config()).generate(
        [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].token_ids
    workers = prefill_workers()
    infos = {w: info(w) for w in workers}
    assert len(workers) == 2 and len({i["node_id"] for i in infos.values()}) == 2

    first = complete(url)
    assert first["choices"][0]["token_ids"] == cold
    fingerprint = next(iter(infos.values()))["fingerprint"]
    index = make_index(config.engine.index, fingerprint, namespace=next(iter(infos.values()))["index_namespace"])
    hashes = PrefixHasher(fingerprint, BLOCK).hashes(PROMPT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = index.lookup(hashes)
        if found.stored == len(hashes) and any(w in workers for w in found.memory):
            break
        time.sleep(0.2)
    assert found.stored == len(hashes), "the prefix never became durable in the shared store"
    assert any(w in workers for w in found.memory), "no prefill worker published a memory lease"
    holders = {w: n for w, n in found.memory.items() if w in workers}     # decode workers hold it too
    holder = max(holders, key=holders.get)
    other = next(w for w in workers if w != holder)

    # repeated: routed to the worker holding the prefix in memory, reused, same tokens
    again = complete(url)
    assert again["choices"][0]["token_ids"] == cold
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(hashes) * BLOCK - BLOCK
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert worker_counter(metrics, "prompt_tokens", holder) == 2 * len(PROMPT), "repeat not routed to the holder"
    assert worker_counter(metrics, "prompt_tokens", other) == 0

    # on the other node: restored from the store node A wrote, then decoded over NIXL
    prefill = serve.get_deployment_handle("Prefill", "reuse")
    decode = serve.get_deployment_handle("Decode", "reuse")
    req = GenRequest("cross-node-1", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    handoff = prefill.prefill.remote(req, hint=RouteHint(require_worker=other)).result()
    assert handoff.worker_id == other and handoff.cached_tokens > 0
    tokens = [handoff.first.token]
    for item in decode.options(stream=True).decode.remote(req, handoff):
        tokens += [t for chunk in (item if isinstance(item, list) else [item]) for t in chunk.token_ids]
    assert tokens == cold
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert worker_counter(metrics, "store_bytes_written", holder) > 0
    index.close()
