"""Prefix reuse on a production trace (tests/data: an excerpt of the Mooncake conversation
trace, Apache-2.0): replayed tokens equal a cold run's, hits are what the hash ids say, the
cost model predicts the replay exactly, and auto's branch-point checkpoints restore fully."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.kvstore.policy.cost import Hardware, ScheduledPeriods, object_sizes, simulate
from kvmesh.kvstore.policy.trace import load_trace
from tests.helpers import random_prompt, write_tiny_checkpoint
from kvmesh.workers.engine import Engine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.replay import replay, stored_payload
from kvmesh.workers.sampling.params import SamplingParams

NAME, BT = "swa_csa_hca", 16
PERIOD = 4 * BT
EXCERPT = Path(__file__).resolve().parents[1] / "data" / "conversation_trace_excerpt.jsonl"
REQUESTS = 12                       # 4,220 prompt tokens; hits for every policy, zero reruns some
POLICIES = ["full", f"periodic:{PERIOD}", "zero", f"auto:{PERIOD}", "auto"]
ANY_HW = Hardware(prefill_tokens_per_s=1e4, store_read_bps=1e9, store_write_bps=1e9)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m"), NAME)


@pytest.fixture(scope="module")
def requests():
    return load_trace(EXCERPT, BT, limit=REQUESTS)


def engine(model_dir, policy: str, store, reuse: bool = True, **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), block_tokens=BT, kv_cache_bytes=16 << 20, swa_policy=policy,
                               store=str(store), prefix_reuse=reuse, **kw))


@pytest.fixture(scope="module")
def cold(model_dir, requests, tmp_path_factory):
    e = engine(model_dir, "full", tmp_path_factory.mktemp("cold"), reuse=False)
    try:
        return replay(e, requests)
    finally:
        e.close()


def hash_id_hits(requests) -> list[int]:
    """Tokens each request can restore under `full`: its longest prefix of full blocks that
    an earlier request also had in full, short of its last token."""
    seen: set[tuple[int, ...]] = set()
    hits = []
    for r in requests:
        full = r.tokens // BT
        n = 0
        while n < (r.tokens - 1) // BT and r.blocks[:n + 1] in seen:
            n += 1
        hits.append(n * BT)
        seen.update(r.blocks[:k] for k in range(1, full + 1))
    return hits


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_trace_replay_equals_cold_run_and_the_cost_model_predicts_it_exactly(model_dir, requests, cold, policy,
                                                                            tmp_path):
    e = engine(model_dir, policy, tmp_path)
    if e.prefix.auto is not None:
        e.prefix.auto.tuner.every = 4      # re-choose the period (from measured figures) as it runs
    try:
        records = replay(e, requests)
        payload = stored_payload(e)
        tuner = ScheduledPeriods(e.prefix.auto.choices) if e.prefix.auto is not None else None
        predicted = simulate(requests, e.layout, e.policy, ANY_HW, tuner=tuner)
        sizes = object_sizes(e.layout, e.policy)
    finally:
        e.close()
    assert [r.token for r in records] == [r.token for r in cold]
    assert [r.logprob for r in records] == pytest.approx([r.logprob for r in cold], abs=1e-4)
    assert sum(r.hit_tokens for r in records) > 0
    if policy == "full":
        assert [r.hit_tokens for r in records] == hash_id_hits(requests)
    assert sum(r.hit_tokens for r in records) == predicted.hit_tokens
    assert sum(r.recompute_tokens for r in records) == predicted.recompute_tokens
    assert sum(size for _, size in payload.values()) == predicted.bytes_written == predicted.bytes_stored
    assert payload["checkpoint"][0] == predicted.checkpoints_written
    assert payload["block"][1] == payload["block"][0] * sizes.block
    if policy == "zero":
        assert predicted.recompute_tokens > 0
    if policy == "auto":
        assert sorted(tuner.choices) == [4, 8, 12]


def test_auto_hits_more_than_periodic_and_stores_a_fraction_of_full(requests):
    from kvmesh.kvstore.device.layout import CacheLayout, LayoutParams
    from kvmesh.kvstore.policy.planner import SwaPolicy
    layout = CacheLayout.build(LayoutParams(("sliding_attention", "compressed_sparse_attention",
                                             "heavily_compressed_attention"), 32, 16, 4, 16, 8, "float32"), BT)
    out = {p: simulate(requests, layout, SwaPolicy.parse(p, BT), ANY_HW) for p in ("full", f"periodic:{PERIOD}",
                                                                                 f"auto:{PERIOD}")}
    assert out[f"auto:{PERIOD}"].hit_tokens > out[f"periodic:{PERIOD}"].hit_tokens
    assert out[f"auto:{PERIOD}"].bytes_stored <= out["full"].bytes_stored / 2


# ---- branch-point checkpoints -------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
DOC = random_prompt(7 * BT + 5, seed=21)
SHARED = 5 * BT                        # ends between the checkpoints at PERIOD and 2 * PERIOD


def branch_prompts() -> list[list[int]]:
    return [DOC, DOC[:SHARED] + random_prompt(20, seed=22), DOC[:SHARED] + random_prompt(25, seed=23)]


@pytest.mark.parametrize("fresh_reader", [False, True], ids=["same_engine", "from_store"])
def test_third_request_branching_mid_period_restores_fully_with_cold_tokens(model_dir, tmp_path, fresh_reader):
    prompts = branch_prompts()
    cold_engine = engine(model_dir, "full", tmp_path / "cold", reuse=False)
    want = [o.token_ids for o in cold_engine.generate(prompts, GREEDY)]
    cold_engine.close()

    e = engine(model_dir, f"auto:{PERIOD}", tmp_path / "store")
    first = e.generate([prompts[0]], GREEDY)[0]
    second = e.generate([prompts[1]], GREEDY)[0]
    assert second.cached_tokens == PERIOD          # the hit ended mid-period: restored at the checkpoint
    if fresh_reader:
        e.flush()
        e.close()
        e = engine(model_dir, f"auto:{PERIOD}", tmp_path / "store")
    before = e.prefix.stats.recomputed_tokens
    third = e.generate([prompts[2]], GREEDY)[0]
    last = e.prefix.stats.last
    e.close()
    assert third.cached_tokens == SHARED           # restored at the branch point the second wrote
    assert last["recompute"] == 0 and e.prefix.stats.recomputed_tokens == before
    assert [first.token_ids, second.token_ids, third.token_ids] == want


def test_periodic_without_branch_points_restores_the_third_request_only_to_its_checkpoint(model_dir, tmp_path):
    e = engine(model_dir, f"periodic:{PERIOD}", tmp_path)
    outs = [e.generate([p], GREEDY)[0] for p in branch_prompts()]
    e.close()
    assert [o.cached_tokens for o in outs] == [0, PERIOD, PERIOD]
