"""The SWA cost model (kvstore.policy.cost) on its own: object sizes equal what the cache stores,
its store evicts as ObjectStore does, the tuner follows the hardware, and `kvmesh
simulate` prints one result per policy."""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from kvmesh.cluster.cli import main
from kvmesh.kvstore.device.cache_tensors import CacheTensors
from kvmesh.kvstore.policy.cost import V4_SHAPES, Hardware, PeriodTuner, StoreModel, object_sizes, simulate
from kvmesh.kvstore.device.layout import CSA, HCA, SWA, CacheLayout, LayoutParams
from kvmesh.kvstore.policy.planner import PolicyError, SwaPolicy
from kvmesh.kvstore.store.object_store import ObjectStore
from kvmesh.kvstore.policy.trace import TraceError, TraceRequest, load_trace, parse_line, prompt_token_ids, scaled_tokens

EXCERPT = Path(__file__).resolve().parents[1] / "data" / "conversation_trace_excerpt.jsonl"
TINY = LayoutParams((SWA, CSA, HCA), 32, 16, 4, 16, 8, "float32")
FP = "ab" * 32


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("policy", ["full", "periodic:32", "zero", "auto"])
def test_object_sizes_equal_what_the_cache_persists(policy, kv):
    layout = CacheLayout.build(dataclasses.replace(TINY, kv_dtype=kv, rope_dim=8), 16)
    pol = SwaPolicy.parse(policy, 16)
    cache = CacheTensors(layout, num_blocks=2, num_slots=1, dtype=torch.float32, swa_blocks=pol.kind == "full")
    sizes = object_sizes(layout, pol)
    assert sizes.block == nbytes(cache.block_state(0))
    assert sizes.checkpoint == nbytes(cache.slot_state(0, 32))


def test_v4_shapes():
    pro, flash = (CacheLayout.build(V4_SHAPES[k], 512) for k in ("V4-Pro", "V4-Flash"))
    assert pro.layer_count_by_type() == {CSA: 30, HCA: 31} and pro.bytes_per_token() == 9848
    assert flash.layer_count_by_type() == {SWA: 2, CSA: 21, HCA: 20}
    full = object_sizes(pro, SwaPolicy("full"))
    assert full.block == 512 * (9848 + 61 * 512 * 2) + 30 * 2 * 4 * (512 + 128) * 2
    fp8 = CacheLayout.build(dataclasses.replace(V4_SHAPES["V4-Pro"], kv_dtype="fp8"), 512)
    assert object_sizes(fp8, SwaPolicy("zero")).block == fp8.block_bytes and round(fp8.bytes_per_token()) == 5511
    assert object_sizes(fp8, SwaPolicy("zero")).checkpoint == object_sizes(pro, SwaPolicy("zero")).checkpoint


def test_auto_policy_strings():
    assert SwaPolicy.parse("auto", 16) == SwaPolicy("auto", 0, True)
    assert SwaPolicy.parse("auto:0", 16) == SwaPolicy("auto", 0)
    assert str(SwaPolicy.parse("auto:64", 16)) == "auto:64"
    for bad in ("auto:10", "auto:-16", "auto:x"):
        with pytest.raises(PolicyError):
            SwaPolicy.parse(bad, 16)


def test_trace_scaling_and_tokens():
    assert scaled_tokens(1000, 2, 16) == 16 + 16 and scaled_tokens(513, 2, 16) == 17
    assert scaled_tokens(6758, 14, 512) == 6758
    a, b = TraceRequest(0, (1, 2), 20, 0), TraceRequest(0, (1, 3), 32, 0)
    ta, tb = prompt_token_ids(a, 16, 300), prompt_token_ids(b, 16, 300)
    assert len(ta) == 20 and ta[:16] == tb[:16] and ta[16:] != tb[16:20]
    with pytest.raises(TraceError, match="x:1: input_length 9999 does not fit"):
        parse_line('{"timestamp": 0, "input_length": 9999, "output_length": 1, "hash_ids": [1]}', 16, "x:1")
    with pytest.raises(TraceError, match="x:2: not a trace request"):
        parse_line('{"hash_ids": "nope"}', 16, "x:2")


def test_store_model_evicts_unread_objects_first_like_the_object_store(tmp_path):
    obj = {"t": torch.zeros(256, dtype=torch.uint8)}
    store = ObjectStore(str(tmp_path), FP, capacity_bytes=None, evict_unread_first=True)
    size = store.put("block", 1, None, 16, obj)
    store = ObjectStore(str(tmp_path / "s"), FP, capacity_bytes=3 * size, evict_unread_first=True)
    model = StoreModel(3 * size, unread_first=True)
    for h in (1, 2, 3):
        store.put("block", h, None, 16, obj)
        model.put(("block", h), size)
    assert store.get("block", 1) is not None
    model.read(("block", 1))
    store.put("block", 4, None, 16, obj)           # over capacity: 2 (unread, oldest) goes, not 1
    model.put(("block", 4), size)
    assert sorted(store.list("block")) == [1, 3, 4]
    assert sorted(h for _, h in model.keys()) == [1, 3, 4]


def test_capacity_limits_what_the_model_stores_and_hits(tmp_path):
    layout = CacheLayout.build(TINY, 16)
    reqs = load_trace(EXCERPT, 16, limit=60)
    free = simulate(reqs, layout, SwaPolicy("full"), Hardware(1e4, 1e9, 1e9))
    tight = simulate(reqs, layout, SwaPolicy("full"), Hardware(1e4, 1e9, 1e9, capacity_bytes=free.bytes_stored // 4))
    assert tight.bytes_stored <= free.bytes_stored // 4 and tight.evicted > 0
    assert tight.hit_tokens < free.hit_tokens


def branching_requests(n: int, seed: int = 0) -> list[TraceRequest]:
    """Requests sharing one long document and branching off it at scattered blocks."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randrange(2, 60)
        out.append(TraceRequest(float(i), tuple(range(k)) + (1000 + i,), (k + 1) * 16 - 3, 0))
    return out


def test_period_tuner_checkpoints_often_when_prefill_is_slow_and_not_at_all_when_it_is_free():
    layout = CacheLayout.build(TINY, 16)
    reqs = branching_requests(64)
    choices = {}
    for name, tps in (("slow", 100.0), ("free", 1e12)):
        tuner = PeriodTuner(layout, Hardware(tps, 1e12, 1e12), every=64, window=64)
        for r in reqs:
            tuner.observe(r)
        assert tuner.due()
        choices[name] = tuner.choose()
    assert 0 < choices["slow"] <= 4 * 16
    assert choices["free"] == 0


def test_simulate_json_has_one_result_per_policy_auto_included(capsys):
    assert main(["simulate", "--trace", str(EXCERPT), "--config", "V4-Flash", "--limit", "80", "--json",
                 "--kv-cache-dtype", "fp8"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["full", "periodic:2048", "periodic:8192", "periodic:32768", "zero", "auto"]
    for r in rows:
        assert set(r) == {"policy", "bytes_stored", "write_gbps", "hit_tokens", "recompute_tokens", "ttft_saved_s"}
    by = {r["policy"]: r for r in rows}
    assert by["auto"]["bytes_stored"] <= by["full"]["bytes_stored"] / 2
    assert by["zero"]["recompute_tokens"] > 0 and by["full"]["recompute_tokens"] == 0


def test_simulate_table_and_bad_arguments(capsys, tmp_path):
    assert main(["simulate", "--trace", str(EXCERPT), "--config", "V4-Pro", "--limit", "40"]) == 0
    assert "auto" in capsys.readouterr().out
    assert main(["simulate", "--trace", str(EXCERPT), "--config", str(tmp_path / "nope")]) == 2
    assert "V4-Pro" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(tmp_path / "missing.jsonl"), "--config", "V4-Pro"]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(EXCERPT), "--config", "V4-Pro", "--periods", "1000"]) == 2


def test_auto_period_fits_prefill_speed_and_step_cost_from_the_engines_steps():
    from kvmesh.workers.reuse.auto_policy import AutoPeriod
    auto = AutoPeriod(CacheLayout.build(TINY, 16))
    for tokens in (16, 64, 256, 16, 512, 32, 128, 1024):
        auto.observe_prefill(tokens, 0.010 + tokens / 5000)
    auto.observe_store((10_000_000, 0.01), (4_000_000, 0.02))
    hw = auto.measured()
    assert hw.step_s == pytest.approx(0.010) and hw.prefill_tokens_per_s == pytest.approx(5000)
    assert hw.store_read_bps == pytest.approx(1e9) and hw.store_write_bps == pytest.approx(2e8)
