"""EngineStats as typed records up to the exporter: the /metrics names they export, the sum
over data-parallel ranks, the trip through pickle (Ray), and what the ingress's collector reads."""
import asyncio
import pickle

from kvmesh.cluster.messages import WorkerStats
from kvmesh.cluster.serve.metrics import WorkerSnapshots
from kvmesh.workers.engine.stats import EngineCounters, EngineStats, Histogram, ReuseCounters, StoreCounters, summed

REUSE_NAMES = ["prefix_query_tokens", "prefix_hit_tokens", "reuse_hits", "reuse_hit_tokens", "reuse_bytes_loaded",
               "reuse_blocks_from_store", "reuse_blocks_from_memory", "reuse_recomputed_tokens", "reuse_errors"]
STORE_NAMES = ["store_bytes_read", "store_bytes_written", "store_reads", "store_writes", "store_corrupt",
               "store_bytes", "store_read_errors", "store_timeouts", "store_quarantined", "store_scrub_objects",
               "store_scrub_passes", "store_scrub_last_pass_s"]


def stats(query: int, tiers: dict, store: StoreCounters | None, running: int = 0) -> EngineStats:
    return EngineStats(running=running, waiting=0, held=0, free_blocks=8, total_blocks=10, free_slots=2,
                       total_slots=4, preemptions=0, kv_cache_usage=0.2, counters=EngineCounters(prompt_tokens=query),
                       queue_time=Histogram().snapshot(),
                       reuse=ReuseCounters(query_tokens=query, hit_tokens_by_tier=tiers, hits=1),
                       store=store)


def test_reuse_and_store_counters_export_under_their_metric_names():
    flat = stats(5, {"device": 3}, StoreCounters(bytes_read=7, bytes=100)).as_dict()
    assert [k for k in flat if k in REUSE_NAMES + STORE_NAMES] == REUSE_NAMES + STORE_NAMES
    assert flat["prefix_query_tokens"] == 5 and flat["prefix_hit_tokens"] == {"device": 3}
    assert flat["store_bytes_read"] == 7 and flat["store_bytes"] == 100
    without = stats(5, {}, None).as_dict()
    assert not any(k.startswith("store_") for k in without) and "reuse_hits" in without


def test_ranks_sum_field_by_field_and_the_shared_store_size_is_not_summed():
    a = stats(5, {"device": 3, "store": 1}, StoreCounters(bytes_read=7, bytes=100), running=1)
    b = stats(2, {"device": 1, "host": 4}, StoreCounters(bytes_read=1, bytes=120), running=2)
    total = summed([a, b])
    assert total.running == 3 and total.counters.prompt_tokens == 7
    assert total.reuse.query_tokens == 7 and total.reuse.hits == 2
    assert total.reuse.hit_tokens_by_tier == {"device": 4, "store": 1, "host": 4}
    assert total.store.bytes_read == 8 and total.store.bytes == 120      # one store every rank sees
    assert summed([stats(1, {}, None), stats(1, {}, None)]).store is None


def test_stats_cross_a_process_boundary_unchanged():
    s = stats(5, {"device": 3}, StoreCounters(reads=2))
    assert pickle.loads(pickle.dumps(s)) == s


def test_the_ingress_collector_reads_the_typed_records():
    snapshots = WorkerSnapshots()
    snapshots.update(WorkerStats("prefill", "w0", stats(5, {"device": 3}, StoreCounters(bytes_written=9), 1)))
    snapshots.update(WorkerStats("decode", "w1", stats(2, {}, None)))
    got = {(s.name, s.labels["worker"], s.labels.get("tier") or s.labels.get("direction")): s.value
           for m in snapshots.collect() for s in m.samples}
    assert got["kvmesh:prefix_cache_queries_total", "w0", None] == 5
    assert got["kvmesh:prefix_cache_hits_total", "w0", "device"] == 3
    assert got["kvmesh:store_bytes_total", "w0", "write"] == 9
    assert got["kvmesh:store_bytes_total", "w1", "read"] == 0        # no store: exported as 0, as before
    assert got["kvmesh:num_requests_running", "w0", None] == 1
    assert got["kvmesh_worker_reuse_hits", "w1", None] == 1
    assert ("kvmesh_worker_store_bytes_written", "w1", None) not in got


def test_the_collector_exports_the_store_scrub_by_result():
    snapshots = WorkerSnapshots()
    scrubbed = StoreCounters(scrub_objects={"ok": 7, "removed": 2, "quarantined": 1}, scrub_passes=3,
                             scrub_last_pass_s=0.5)
    snapshots.update(WorkerStats("prefill", "w0", stats(5, {}, scrubbed)))
    snapshots.update(WorkerStats("decode", "w1", stats(2, {}, None)))
    got = {(s.name, s.labels["worker"], s.labels.get("result")): s.value for m in snapshots.collect() for s in m.samples}
    assert got["kvmesh_store_scrub_objects_total", "w0", "removed"] == 2
    assert got["kvmesh_store_scrub_objects_total", "w0", "ok"] == 7
    assert got["kvmesh_worker_store_scrub_passes", "w0", None] == 3
    assert got["kvmesh_worker_store_scrub_last_pass_s", "w0", None] == 0.5
    assert not any(k[0].startswith("kvmesh_store_scrub") and k[1] == "w1" for k in got)     # no store, no rows
    total = summed([stats(1, {}, scrubbed), stats(1, {}, scrubbed)]).store
    assert total.scrub_objects["removed"] == 4 and total.scrub_last_pass_s == 0.5


def test_a_scrape_sums_the_ingress_replicas_series():
    """Two ingress replicas' registries: counters and histograms are summed sample by sample, the
    KV event index's view is the largest, `_created` is dropped, and the text says how many answered."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvmesh.cluster.serve.metrics import Metrics, merge_families

    a, b = Metrics(), Metrics()
    for m, n in ((a, 3), (b, 5)):
        for _ in range(n):
            m.request("completions", 200)
            m.ttft.observe(0.2)
        m.request("chat", 400)
        m.tokens(10 * n)
    merged = {s.name: s for f in merge_families([a.families(), b.families()]) for s in f.samples
              if s.labels.get("endpoint", "completions") == "completions" and s.labels.get("le", "+Inf") == "+Inf"}
    assert merged["kvmesh_requests_total"].value == 8
    assert merged["kvmesh_time_to_first_token_seconds_count"].value == 8
    assert merged["kvmesh_time_to_first_token_seconds_bucket"].value == 8
    assert merged["kvmesh_generated_tokens_total"].value == 80
    assert not any(name.endswith("_created") for name in merged)

    async def both():
        return {"r1": a.families(), "r2": b.families()}
    text = asyncio.run(a.exposition(both)).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("kvmesh_requests_total", (("endpoint", "completions"), ("status", "200")))] == 8
    assert samples[("kvmesh_requests_total", (("endpoint", "chat"), ("status", "400")))] == 2
    assert samples[("kvmesh_ingress_replicas_scraped", ())] == 2
    alone = asyncio.run(a.exposition()).decode()        # no peers (tests, a bare Metrics): its own series
    assert 'kvmesh_requests_total{endpoint="completions",status="200"} 3.0' in alone
