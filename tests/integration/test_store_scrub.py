"""The store cleans itself (issue 31): on a store the real engine wrote (and published to a real
Redis index), `kvmesh store scrub` (a subprocess) removes the damaged objects nobody reads,
a second scrub finds nothing, and a request over the scrubbed prefix gives the cold run's greedy
tokens - with the index told (`--index`) or left stale. A serving engine's background pass does
the same on its own (and unpublishes), counts it for /metrics, and never touches another store
key's namespace in the same store directory."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvmesh.cluster.messages import WorkerStats
from kvmesh.cluster.serve.metrics import WorkerSnapshots
from kvmesh.kvstore.index.embedded import make_index
from tests.helpers import random_prompt, write_tiny_checkpoint
from kvmesh.workers.engine import Engine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.sampling.params import SamplingParams

BT = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = random_prompt(100, seed=31)        # 6 full blocks
KEY = "s" * 32
CLI = [sys.executable, "-m", "kvmesh.cluster.cli", "store", "scrub"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # a seed of its own: its own fingerprint, so its Redis namespace is this module's alone
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m"), "swa_csa_hca", seed=31)


def engine(model_dir, store=None, index="local", **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), block_tokens=BT, kv_cache_bytes=16 << 20, swa_policy="periodic:32",
                               store=str(store) if store else None, index=index, store_read_timeout_s=1.0, **kw))


@pytest.fixture(scope="module")
def cold(model_dir):
    e = engine(model_dir)
    try:
        return e.generate([PROMPT], GREEDY)[0].token_ids
    finally:
        e.close()


def written(model_dir, store: Path, index: str, **kw) -> tuple[str, list[int]]:
    """Run the prompt on an engine over `store`; its namespace directory and block hashes."""
    e = engine(model_dir, store, index, **kw)
    try:
        e.generate([PROMPT], GREEDY)
        e.flush()
        return e.prefix.store.directory, e.prefix.hasher.hashes(PROMPT)
    finally:
        e.close()


def damage(ns_dir: str, hashes: list[int]) -> int:
    """Block 2 a FIFO, block 4 bit-flipped, a checkpoint truncated, a stale temp file: 4 to remove."""
    block = Path(ns_dir) / "block"
    path = block / f"{hashes[2]:016x}.kv"
    path.unlink()
    os.mkfifo(path)
    flipped = bytearray((block / f"{hashes[4]:016x}.kv").read_bytes())
    flipped[-1] ^= 1
    (block / f"{hashes[4]:016x}.kv").write_bytes(flipped)
    checkpoint = sorted((Path(ns_dir) / "checkpoint").iterdir())[0]
    checkpoint.write_bytes(checkpoint.read_bytes()[:100])
    tmp = block / f".{hashes[5]:016x}.kv.{'0' * 32}.tmp"
    tmp.write_bytes(b"half")
    os.utime(tmp, (1e9, 1e9))
    return 4


def tree(root: str) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "-" for p in Path(root).rglob("*")}


def scrub(store: Path, *args: str) -> dict:
    out = subprocess.run(CLI + ["--store", str(store), "--json", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def served(model_dir, store: Path, index: str) -> list[int]:
    e = engine(model_dir, store, index, store_scrub_interval_s=0)
    try:
        return e.generate([PROMPT], GREEDY)[0].token_ids
    finally:
        e.close()


def test_the_cli_scrub_cleans_the_store_and_a_request_after_it_is_the_cold_run(model_dir, cold, tmp_path, redis_server):
    store = tmp_path / "store"
    keyed_dir, _ = written(model_dir, store, "local", store_key=KEY)      # another key's namespace, same root
    flipped = next((Path(keyed_dir) / "block").iterdir())
    flipped.write_bytes(flipped.read_bytes()[:-1])
    keyed = tree(keyed_dir)
    ns_dir, hashes = written(model_dir, store, redis_server)
    n = damage(ns_dir, hashes)
    ns = Path(ns_dir).name
    index = make_index(redis_server, Path(ns_dir, "FINGERPRINT").read_text(), namespace=ns)
    try:
        report = scrub(store, "--namespace", ns)              # the index is not told: its entries go stale
        assert (report["removed"], report["quarantined"], report["complete"]) == (n, 0, True)
        assert report["found"] == {"not_regular": 1, "corrupt": 2, "stale_tmp": 1}
        assert scrub(store, "--namespace", ns)["clean"]
        assert tree(keyed_dir) == keyed                      # the other key's namespace, its bad object too
        assert index.lookup(hashes).stored > 2         # still claims the removed block 2
        assert served(model_dir, store, redis_server) == cold        # a stale entry is a miss, recomputed
        n = damage(ns_dir, hashes)                           # again, with the index told this time
        assert scrub(store, "--namespace", ns, "--index", redis_server)["removed"] == n
        assert index.lookup(hashes).stored == 2
        assert served(model_dir, store, redis_server) == cold
    finally:
        index.close()


def test_the_background_pass_of_a_serving_engine_scrubs_its_own_namespace(model_dir, cold, tmp_path, redis_server):
    store = tmp_path / "store"
    keyed_dir, _ = written(model_dir, store, "local", store_key=KEY)
    (Path(keyed_dir) / "block" / f"{0:016x}.kv").write_bytes(b"")     # bad, but another key's
    keyed = tree(keyed_dir)
    ns_dir, hashes = written(model_dir, store, redis_server)
    n = damage(ns_dir, hashes)
    e = engine(model_dir, store, redis_server, store_scrub_interval_s=0.2)
    try:
        deadline = time.monotonic() + 20
        while e.stats().store.scrub_passes < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = e.stats().store
        assert stats.scrub_passes >= 2 and stats.scrub_objects["removed"] == n
        assert not (Path(ns_dir) / "block" / f"{hashes[2]:016x}.kv").exists()
        assert e.prefix.index.lookup(hashes).stored == 2          # unpublished as they went
        assert tree(keyed_dir) == keyed
        snapshots = WorkerSnapshots()
        snapshots.update(WorkerStats("prefill", "w0", e.stats()))
        exported = {(s.name, s.labels.get("result")): s.value for m in snapshots.collect() for s in m.samples}
        assert exported["kvmesh_store_scrub_objects_total", "removed"] == n
        assert exported["kvmesh_store_scrub_objects_total", "ok"] >= 1
        assert e.generate([PROMPT], GREEDY)[0].token_ids == cold
    finally:
        e.close()
