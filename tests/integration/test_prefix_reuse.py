"""Invariant 3 and 5 for prefix reuse: a restored run (any SWA policy, any hit length,
from memory or from the store) equals the cold run; corrupt objects, a stopped Redis and
a full store never change the output. A store hit is read off the engine step, while its
request is parked (issue 45): no store read on the step's thread, and a read that misses its
deadline is recomputed, with the same tokens."""
from __future__ import annotations

import threading
import time

import pytest

from kvmesh.kvstore.policy.planner import recompute_span
from tests.helpers import assert_same_run, random_prompt, reference_greedy, write_tiny_checkpoint
from kvmesh.workers.engine import Engine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.sampling.params import SamplingParams

NAME, BT, WINDOW, LAYERS, MAX_RATIO = "swa_csa_hca", 16, 8, 3, 16
PERIOD = 2 * BT
POLICIES = ["full", f"periodic:{PERIOD}", "zero"]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
BASE = random_prompt(230, seed=7)          # the document every later prompt shares a prefix of
TOL = 2e-4


def other(n: int, seed: int) -> list[int]:
    return random_prompt(n, seed=1000 + seed)


# name -> (prompt sharing a prefix with BASE, length of the shared prefix)
CASES = {
    "miss": ([BASE[0] + 1] + BASE[1:120], 0),
    "one_block": (BASE[:BT] + other(40, 1), BT),
    "many_blocks": (BASE[:10 * BT] + other(7, 2), 10 * BT),
    "whole_prompt": (BASE, len(BASE)),
    "one_past_boundary": (BASE[:12 * BT + 1], 12 * BT + 1),
    "at_checkpoint": (BASE[:3 * PERIOD] + other(9, 3), 3 * PERIOD),
    "just_after_checkpoint": (BASE[:3 * PERIOD + BT] + other(9, 4), 3 * PERIOD + BT),
}


def expected_cached(policy: str, prompt_len: int, shared: int) -> int:
    blocks = min(shared // BT, (prompt_len - 1) // BT)
    if policy == "full":
        return blocks * BT
    if policy.startswith("periodic"):
        # checkpoints of BASE: every PERIOD tokens and at its prompt end (its last block boundary)
        ckpts = [c for c in range(PERIOD, len(BASE) + 1, PERIOD)] + [len(BASE) // BT * BT]
        return max([c for c in ckpts if c <= blocks * BT], default=0)
    span = recompute_span(LAYERS, WINDOW, MAX_RATIO)
    start = max(0, blocks * BT - span) // BT * BT
    return start


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m"), NAME)


def engine(model_dir, policy="full", **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), block_tokens=BT, kv_cache_bytes=16 << 20,
                               swa_policy=policy, **kw))


@pytest.fixture(scope="module")
def cold(model_dir):
    """Cold single runs (no reuse possible): the ground truth for every restored run."""
    e = engine(model_dir)
    return {name: e.generate([prompt], GREEDY)[0] for name, (prompt, _) in CASES.items()}



@pytest.mark.parametrize("policy", POLICIES)
def test_restore_from_the_store_equals_the_cold_run_for_every_hit_length(model_dir, cold, tmp_path, policy):
    writer = engine(model_dir, policy, store=str(tmp_path))
    writer.generate([BASE], GREEDY)
    writer.flush()
    for name, (prompt, shared) in CASES.items():
        reader = engine(model_dir, policy, store=str(tmp_path))   # fresh engine: nothing in memory
        out = reader.generate([prompt], GREEDY)[0]
        assert_same_run(out, cold[name])
        assert out.cached_tokens == expected_cached(policy, len(prompt), shared), name


@pytest.mark.parametrize("policy", POLICIES)
def test_restore_from_worker_memory_equals_the_cold_run(model_dir, cold, policy):
    e = engine(model_dir, policy)          # no store: the worker's own memory is the only tier
    e.generate([BASE], GREEDY)
    for name in ("one_block", "many_blocks", "whole_prompt", "at_checkpoint"):
        prompt, shared = CASES[name]
        out = e.generate([prompt], GREEDY)[0]
        assert_same_run(out, cold[name])
        assert out.cached_tokens == expected_cached(policy, len(prompt), shared), name
    assert e.prefix.stats.blocks_from_store == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_restored_run_equals_the_transformers_reference(model_dir, tmp_path, policy):
    writer = engine(model_dir, policy, store=str(tmp_path))
    writer.generate([BASE], GREEDY)
    writer.flush()
    prompt, _ = CASES["many_blocks"]
    out = engine(model_dir, policy, store=str(tmp_path)).generate([prompt], GREEDY)[0]
    assert out.cached_tokens > 0
    tokens, logprobs = reference_greedy(model_dir, prompt, GREEDY.max_tokens)
    assert out.token_ids == tokens
    assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < TOL


def test_a_multi_turn_chat_reuses_the_previous_turn_including_its_output(model_dir, tmp_path):
    e = engine(model_dir, f"periodic:{PERIOD}", store=str(tmp_path))
    first = e.generate([BASE], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    turn2 = BASE + first.token_ids + other(5, 9)
    e.flush()
    out = engine(model_dir, f"periodic:{PERIOD}", store=str(tmp_path)).generate([turn2], GREEDY)[0]
    assert out.cached_tokens == (len(BASE) + 40) // BT * BT     # the end-of-output checkpoint
    assert_same_run(out, engine(model_dir).generate([turn2], GREEDY)[0])


def test_corrupt_and_truncated_objects_are_misses_and_output_stays_exact(model_dir, cold, tmp_path):
    writer = engine(model_dir, store=str(tmp_path))
    writer.generate([BASE], GREEDY)
    writer.flush()
    files = {p.stem: p for p in tmp_path.rglob("block/*.kv")}
    chain = writer.prefix.chain(writer.seqs.get("x") or _seq(BASE), 12)
    from kvmesh.kvstore.hashing import hash_hex
    corrupt, truncate = files[hash_hex(chain[4])], files[hash_hex(chain[8])]
    data = bytearray(corrupt.read_bytes())
    data[-10] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    truncate.write_bytes(truncate.read_bytes()[:100])
    reader = engine(model_dir, store=str(tmp_path))
    prompt, _ = CASES["many_blocks"]
    out = reader.generate([prompt], GREEDY)[0]
    assert_same_run(out, cold["many_blocks"])
    assert out.cached_tokens == 4 * BT                      # the hit stops before the corrupt block
    assert reader.prefix.store.stats().corrupt == 2                 # both found, counted and removed
    reader.flush()                                          # the recomputed blocks were written anew
    assert reader.prefix.store.get("block", chain[4]) is not None
    assert reader.prefix.index.lookup(chain[:10]).stored == 10


def _seq(tokens):
    from kvmesh.workers.request import Sequence
    return Sequence("x", list(tokens), GREEDY)


def test_store_at_its_capacity_evicts_and_never_fails_a_request(model_dir, cold, tmp_path):
    e = engine(model_dir, store=str(tmp_path), store_capacity_bytes=40_000)
    for name, (prompt, _) in CASES.items():
        assert_same_run(e.generate([prompt], GREEDY)[0], cold[name])
        e.flush()
    stats = e.prefix.store.stats()
    assert stats.total_bytes <= 40_000 and stats.evicted > 0


def test_redis_index_survives_redis_stopping_and_resumes_reuse_after_restart(model_dir, cold, tmp_path,
                                                                             redis_process):
    spec = redis_process.url
    writer = engine(model_dir, store=str(tmp_path), index=spec)
    writer.generate([BASE], GREEDY)
    writer.flush()
    prompt, _ = CASES["many_blocks"]
    redis_process.stop()
    try:
        down = engine(model_dir, store=str(tmp_path), index=spec)
        out = down.generate([prompt], GREEDY)[0]
        assert_same_run(out, cold["many_blocks"])
        assert out.cached_tokens == 0                       # no index: served without reuse
    finally:
        redis_process.restart()
    # a restarted Redis without persistence is empty; the store is the truth and re-seeds it
    out = down.generate([prompt], GREEDY)[0]                # the same engine, once Redis answers again
    assert_same_run(out, cold["many_blocks"])
    up = engine(model_dir, store=str(tmp_path), index=spec)
    out = up.generate([prompt], GREEDY)[0]
    assert_same_run(out, cold["many_blocks"])
    assert out.cached_tokens == 10 * BT


@pytest.mark.slow     # two CLI subprocesses: ~7 s
@pytest.mark.parametrize("index", ["local", "redis"])
def test_a_second_kvmesh_generate_process_reuses_what_the_first_wrote(model_dir, tmp_path, index, redis_server):
    import json
    import subprocess
    import sys
    spec = redis_server if index == "redis" else "local"
    prompt = BASE[:10 * BT] + other(7, 2)
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "q", "prompt_token_ids": prompt, "max_tokens": 5,
                                                   "temperature": 0.0, "ignore_eos": True}) + "\n")
    results = []
    for run in range(2):
        out = tmp_path / f"out{run}.jsonl"
        cmd = [sys.executable, "-m", "kvmesh.cluster.cli", "generate", "--model", str(model_dir), "--input",
               str(tmp_path / "in.jsonl"), "--output", str(out), "--block-tokens", str(BT), "--kv-cache-bytes", "16MiB",
               "--store", str(tmp_path / "store"), "--index", spec, "--swa-policy", "full"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        results.append(json.loads(out.read_text()))
    assert results[0]["cached_tokens"] == 0
    assert results[1]["cached_tokens"] == 10 * BT           # a fresh process, restored from the store
    assert results[1]["token_ids"] == results[0]["token_ids"]


def spy_reads(e: Engine) -> list[str]:
    """The thread of every read of `e`'s store (the real store, wrapped to note who calls it)."""
    threads, store = [], e.prefix.store
    real = store.get_many

    def noted(*args, **kw):
        threads.append(threading.current_thread().name)
        return real(*args, **kw)
    store.get_many = noted
    return threads


def test_a_store_hit_is_read_off_the_step_while_its_request_is_parked(model_dir, cold, tmp_path):
    writer = engine(model_dir, store=str(tmp_path))
    writer.generate([BASE], GREEDY)
    writer.flush()
    reader = engine(model_dir, store=str(tmp_path))
    threads = spy_reads(reader)
    prompt, shared = CASES["many_blocks"]
    reader.add_request("r", prompt, GREEDY)
    assert len(reader.restore_wait) == 1 and not reader.scheduler.has_work()     # parked, not scheduled
    out = reader.generate([CASES["whole_prompt"][0]], GREEDY)[0]     # runs "r" alongside
    assert_same_run(out, cold["whole_prompt"])
    assert threads and all(t.startswith("kvmesh-prefetch") for t in threads), threads
    assert reader.prefix.stats.tier_hit_tokens["store"] >= shared


def test_a_prefetch_reads_its_blocks_in_parts_side_by_side(model_dir, cold, tmp_path, monkeypatch):
    """store_reads_in_flight: once its first reads were slow, one request's store reads run as
    parts at once (what a store that answers each read after a while needs); the hit and the
    tokens are the cold run's."""
    from kvmesh.workers.reuse import prefix_cache
    monkeypatch.setattr(prefix_cache, "PART_MIN_OBJECTS", 2)
    writer = engine(model_dir, store=str(tmp_path))
    writer.generate([BASE], GREEDY)
    writer.flush()
    reader = engine(model_dir, store=str(tmp_path), store_reads_in_flight=3)
    store, real, calls = reader.prefix.store, reader.prefix.store.get_many, []

    def slow(kind, hashes, *args, **kw):        # each read answers after 0.3 s
        start = time.monotonic()
        time.sleep(0.3)
        out = real(kind, hashes, *args, **kw)
        calls.append((threading.current_thread().name, kind, len(hashes), start, time.monotonic()))
        return out
    store.get_many = slow
    prompt, shared = CASES["whole_prompt"]
    out = reader.generate([prompt], GREEDY)[0]
    assert_same_run(out, cold["whole_prompt"])
    blocks = [c for c in calls if c[1] == "block"]
    first, parts = blocks[0], blocks[1:]           # the first 2 alone (slow: 0.15 s an object), then the rest
    assert first[2] == 2 and len(parts) == 3 and len({c[0] for c in parts}) == 3, calls    # three parts, three threads
    assert max(c[3] for c in parts) < min(c[4] for c in parts), calls           # all three in flight at once
    assert sum(c[2] for c in blocks) == (len(prompt) - 1) // BT
    assert reader.prefix.stats.tier_hit_tokens["store"] >= (len(prompt) - 1) // BT * BT
    monkeypatch.setattr(prefix_cache, "SLOW_READ_S", 0.1)    # local files, far under it even under load: no parts
    fast = engine(model_dir, store=str(tmp_path), store_reads_in_flight=3)
    threads = spy_reads(fast)
    assert_same_run(fast.generate([prompt], GREEDY)[0], cold["whole_prompt"])
    assert len(threads) == 2 and len(set(threads)) == 1, threads               # the first 2, then the rest


def test_a_read_past_its_deadline_is_recomputed_with_the_same_tokens(model_dir, cold, tmp_path):
    writer = engine(model_dir, store=str(tmp_path))
    writer.generate([BASE], GREEDY)
    writer.flush()
    reader = engine(model_dir, store=str(tmp_path), restore_wait_s=0.05, restore_wait_s_per_1k_tokens=0.0)
    store = reader.prefix.store
    slow = store.get_many

    def late(*args, **kw):      # the store answers after the request's deadline
        time.sleep(0.5)
        return slow(*args, **kw)
    store.get_many = late
    threads = spy_reads(reader)
    out = reader.generate([CASES["many_blocks"][0]], GREEDY)[0]
    assert_same_run(out, cold["many_blocks"])
    assert out.cached_tokens == 0 and reader.prefix.stats.tier_hit_tokens["store"] == 0
    assert threads and all(t.startswith("kvmesh-prefetch") for t in threads), threads


def test_more_store_hits_than_the_pool_holds_all_finish_exactly(model_dir, cold, tmp_path):
    """Eight requests whose hits come from the store, all at once, on a KV pool that holds about
    two of them: each is parked while its reads run (holding no block and no slot), then
    scheduled as memory frees; every one finishes with the cold run's tokens."""
    writer = engine(model_dir, store=str(tmp_path))
    writer.generate([BASE], GREEDY)
    writer.flush()
    names = ["many_blocks", "whole_prompt", "one_past_boundary", "at_checkpoint"] * 2
    reader = Engine(EngineConfig(model=str(model_dir), block_tokens=BT, kv_cache_bytes=512 << 10, store=str(tmp_path)))
    assert reader.blocks.num_blocks * BT < sum(len(CASES[n][0]) for n in names) / 3     # room for about two
    for i, name in enumerate(names):
        reader.add_request(f"r{i}", CASES[name][0], GREEDY)
    assert len(reader.restore_wait) == len(names) and reader.blocks.num_used == 0     # parked: hold nothing
    outs = {}
    while reader.has_unfinished():
        outs.update((o.request_id, o) for o in reader.step() if o.finished)
    for i, name in enumerate(names):
        assert_same_run(outs[f"r{i}"], cold[name])
    assert reader.prefix.stats.tier_hit_tokens["store"] > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_restore_beside_running_requests_is_copied_off_the_step_and_a_failed_copy_recomputes(
        model_dir, cold, tmp_path, policy):
    """Issue 45: a store hit admitted while others run is written into its reserved blocks on a
    loader thread — the running request keeps stepping, the restoring one is out of the batch
    with its memory held — and joins with the cold run's tokens; a copy that fails makes it
    recompute from scratch (same tokens), never fail. Nobody running: the copy is in the step."""
    writer = engine(model_dir, policy, store=str(tmp_path))
    writer.generate([BASE], GREEDY)
    writer.flush()
    reader = engine(model_dir, policy, store=str(tmp_path))
    real, gate, threads = reader.prefix.write, threading.Event(), []

    def gated(*args, **kw):
        threads.append(threading.current_thread().name)
        if threading.current_thread() is not threading.main_thread():
            gate.wait(30)
        return real(*args, **kw)
    reader.prefix.write = gated
    busy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reader.add_request("busy", other(20, 9), busy)
    reader.step()
    prompt, shared = CASES["whole_prompt"]
    reader.add_request("warm", prompt, GREEDY)
    for _ in range(40):                        # its prefetch, then admission: the copy waits on the gate
        outs = reader.step()
        assert [o.request_id for o in outs] == ["busy"]
        if reader.kv.loading:
            break
    assert reader.kv.loading == 1 and reader.scheduler.loading and threads[-1].startswith("kvmesh-cache-load")
    held = reader.blocks.num_used
    for _ in range(3):                         # the running request goes on; the restoring one holds its memory
        assert [o.request_id for o in reader.step()] == ["busy"] and reader.blocks.num_used >= held
    gate.set()
    outs = {o.request_id: o for o in run_all(reader) if o.finished}
    assert_same_run(outs["warm"], cold["whole_prompt"])
    assert outs["warm"].cached_tokens == expected_cached(policy, len(prompt), shared) > 0

    failing = engine(model_dir, policy, store=str(tmp_path))
    works = failing.prefix.write

    def broken(*args, **kw):
        if threading.current_thread() is not threading.main_thread():
            raise OSError("copy failed")
        return works(*args, **kw)
    failing.prefix.write = broken
    failing.add_request("busy", other(20, 9), busy)
    failing.step()
    failing.add_request("warm", prompt, GREEDY)
    outs = {o.request_id: o for o in run_all(failing) if o.finished}
    assert_same_run(outs["warm"], cold["whole_prompt"])
    assert outs["warm"].cached_tokens == 0 and failing.prefix.stats.errors == 1 and failing.kv.loading == 0


def run_all(e: Engine) -> list:
    out = []
    while e.has_unfinished():
        out += e.step()
    return out


def test_a_miss_joins_the_next_step_and_a_hit_that_reads_is_not_waited_for(model_dir, cold, tmp_path, monkeypatch):
    """Issue 45 item 2: a request parked for its prefetch whose lookup finds nothing to read (a
    miss) is scheduled by the first step after it arrives — the step waits for new lookups (at
    most MISS_WAIT_S; long here, so the test does not race the loader thread) — holding no memory
    while parked; one whose hit reads the store is left to its reads, the step not waiting for them."""
    from kvmesh.workers.engine import engine as engine_module
    monkeypatch.setattr(engine_module, "MISS_WAIT_S", 30.0)
    writer = engine(model_dir, store=str(tmp_path))
    writer.generate([BASE], GREEDY)
    writer.flush()
    reader = engine(model_dir, store=str(tmp_path))
    reader.add_request("busy", other(20, 9), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    reader.step()
    gate, real = threading.Event(), reader.prefix.store.get_many

    def gated(*args, **kw):
        gate.wait(30)
        return real(*args, **kw)
    reader.prefix.store.get_many = gated
    lookup = reader.prefix._lookup

    def slow_lookup(hashes):         # an index that answers after the step would have begun
        time.sleep(0.2)
        return lookup(hashes)
    reader.prefix._lookup = slow_lookup
    used = reader.blocks.num_used
    miss, _ = CASES["miss"]
    reader.add_request("miss", miss, GREEDY)
    reader.add_request("hit", CASES["many_blocks"][0], GREEDY)
    assert len(reader.restore_wait) == 2 and reader.blocks.num_used == used    # parked: they hold nothing
    t0 = time.monotonic()
    reader.step()
    assert time.monotonic() - t0 < 10             # the hit's reads (held back) were not waited for
    assert reader.seqs["miss"].num_computed > 0 and len(reader.restore_wait) == 1     # the miss ran at once
    gate.set()
    outs = {o.request_id: o for o in run_all(reader) if o.finished}
    assert_same_run(outs["miss"], cold["miss"])
    assert_same_run(outs["hit"], cold["many_blocks"])
    assert outs["hit"].cached_tokens == 10 * BT
