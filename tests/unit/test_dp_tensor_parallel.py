"""Tensor parallelism inside data-parallel ranks on the CPU (gloo): a DP=2 x TP=2 replica (four
processes: each DP rank's engine leads a TP group of two, the routed experts split over all four)
equals the TP=1 engine, token for token and logprobs within 1e-4, on two tiny configs (all three
layer types; odd windows and ratios): batched, prefilled in chunks, restored from the store under
an SWA policy, prompts of odd lengths (a group's step with fewer tokens than ranks), one group
idle, forks; every rank of a group holds the same cache, byte for byte; what DP x TP stores TP=1
restores. On the built-in model (it has an MTP layer) it drafts with speculation k = 2 under EPLB
(redundant experts moving between all four ranks) and drafts and accepts exactly what one
process does. Handoffs between layouts (a DP=2 prefill pool to a DP=2 x TP=2 decode pool and
back, over NIXL into and out of a group's rank 0, whose group then holds the same bytes) equal a
cold run. Bad sizes fail at start-up naming the numbers; a killed rank of a group is RankFailed for
the whole replica. A shared expert an FP8 block keeps whole stays exact; the plan's per-rank bytes
are what a rank holds.

One DP x TP engine per config for the module: starting one costs three process spawns."""
from __future__ import annotations

import time

import pytest

from kvmesh.cluster.serve.transfer import Loader
from kvmesh.kvstore.transfer.kv_transport import GatheredTransport
from kvmesh.workers.engine import open_engine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.model.args import ConfigError
from kvmesh.workers.request import Resume
from kvmesh.workers.sampling.params import SamplingParams
from tests.helpers import (BLOCK_TOKENS, assert_rank_failure_is_quick, assert_same_outputs, cold_references,
                           random_prompt, run_to_end, stored_by_tp1, tiny_engine, write_tiny_checkpoint)
from tests.quant_checkpoint import quantize_checkpoint

pytestmark = pytest.mark.slow     # gloo process groups: three spawned ranks per replica

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
FORKS = SamplingParams(max_tokens=6, temperature=0.8, n=2, seed=3, ignore_eos=True)
DP = dict(data_parallel_size=2, enable_expert_parallel=True)
DPTP = dict(DP, tensor_parallel_size=2)
CONFIGS = {"swa_csa_hca": "periodic", "csa_hca_odd_window": "full"}     # -> the SWA policy of its store


def policy(name: str) -> str:
    return f"periodic:{2 * BLOCK_TOKENS[name]}" if CONFIGS[name] == "periodic" else CONFIGS[name]


def prompts(name: str) -> dict[str, list[list[int]]]:
    """A: stored by TP=1 before the DP x TP engine starts; A_ext continues A's first 4 blocks.
    B: first run at DP x TP (odd lengths, one of 1 token); B_ext continues B[0]; idle: run alone."""
    bt = BLOCK_TOKENS[name]
    a = [random_prompt(4 * bt + 5, seed=1), random_prompt(5 * bt + 1, seed=2)]
    b = [random_prompt(4 * bt + 3, seed=3), random_prompt(3 * bt + 1, seed=4), random_prompt(7, seed=5),
         random_prompt(2 * bt + 1, seed=6), random_prompt(1, seed=7)]
    ext = lambda ps, s: [p[:4 * bt] + random_prompt(9, seed=s + i) for i, p in enumerate(ps)]  # noqa: E731
    return {"A": a, "A_ext": ext(a, 10), "B": b, "B_ext": ext(b[:1], 20), "idle": [random_prompt(2 * bt + 3, seed=50)]}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def dptp(request, tmp_path_factory):
    """(name, path, refs, store, DP=2 x TP=2 engine over a store TP=1 wrote A into)."""
    name = request.param
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(name), name)
    refs = cold_references(path, name, prompts(name), GREEDY, FORKS)     # TP=1, no store: the reference
    store = stored_by_tp1(path, name, str(tmp_path_factory.mktemp("store")), policy(name), prompts(name)["A"], GREEDY)
    engine = tiny_engine(path, name, **DPTP, swa_policy=policy(name), store=store,
                         max_batched_tokens=3 * BLOCK_TOKENS[name] + 1)
    yield name, path, refs, store, engine
    engine.close()


def assert_groups_agree(engine) -> None:
    """Every TP group's ranks hold the same cache bytes; the groups' caches differ (their own requests)."""
    digests = engine.cache_digests()
    assert [len(set(g)) for g in digests] == [1, 1] and len(digests[0]) == 2, digests
    assert digests[0][0] != digests[1][0]


def test_dp2_tp2_batched_chunked_restored_and_forked_equals_tp1_and_tp1_restores_what_it_stored(dptp):
    name, path, refs, store, engine = dptp
    ps = prompts(name)
    shard = engine.local.model.layers[0].attn.shard
    assert (shard.size, shard.dp_rank, shard.dp_size) == (2, 0, 4)          # TP group of 2, experts over 4 ranks
    assert engine.local.model.layers[0].ffn.experts.w1.shape[0] == 1
    out = engine.generate(ps["A_ext"] + ps["B"], GREEDY)      # A_ext from TP=1's store objects, B cold
    assert all(o.cached_tokens > 0 for o in out[:len(ps["A_ext"])])
    assert_same_outputs(out, refs["A_ext"] + refs["B"])
    prompt_tokens = [s.counters.prompt_tokens for s in engine.rank_stats]
    assert all(prompt_tokens) and prompt_tokens[0] != prompt_tokens[1]         # both groups, batches differ
    assert_groups_agree(engine)
    forks = engine.generate(ps["B"][:1], FORKS)
    assert [o.token_ids for o in forks] == [r.token_ids for r in refs["forks"]]
    engine.flush()
    reader = tiny_engine(path, name, swa_policy=engine.config.swa_policy, store=store)
    again = reader.generate(ps["B_ext"], GREEDY)              # B's blocks and state as a DP x TP group stored them
    reader.close()
    assert all(o.cached_tokens > 0 for o in again)
    assert_same_outputs(again, refs["B_ext"])


def test_one_group_idle_joins_the_exchanges_of_the_other(dptp):
    name, _, refs, _, engine = dptp
    steps = [s.counters.steps for s in engine.rank_stats]
    rank = engine.add_request("alone", prompts(name)["idle"][0], GREEDY, rank=1)
    assert_same_outputs([o for o in run_to_end(engine) if o.finished], refs["idle"])
    ran = [s.counters.steps - b for s, b in zip(engine.rank_stats, steps)]
    assert ran[rank] > 0 and ran[1 - rank] == 0
    assert_groups_agree(engine)


def test_each_rank_holds_the_weights_kvmesh_plan_counts_for_its_row(dptp):
    """`kvmesh plan`'s per-rank bytes for TP 2 x DP 2 (sizing.WeightSplit.per_rank) are what rank 0 of
    the replica holds: attention, shared expert and vocabulary halves, one of the four experts."""
    from kvmesh.workers.checkpoint.sizing import split_from_config
    name, path, *_, engine = dptp
    held = sum(t.numel() * t.element_size() for k, t in engine.local.model.state_dict().items()
               if not k.startswith("ropes."))
    split = split_from_config(engine.args, mtp_layers=len(engine.local.model.mtp))
    assert held == split.per_rank(2, 2) < split.per_rank(1, 2)       # DP 2 alone: attention whole on every rank


# ---- speculation and EPLB on the built-in model (it has an MTP layer) ------------------------------
def test_speculation_with_eplb_drafts_and_accepts_what_one_process_does():
    from tests.unit.test_speculative_parallel import CHUNK, GREEDY as LONG, PROMPTS, drafted, engine_with, staggered
    plain = staggered(engine_with(speculative_tokens=0, **CHUNK))
    one = engine_with(speculative_tokens=2, **CHUNK)
    assert staggered(one) == plain
    want = drafted(one)
    one.close()
    engine = engine_with(**DPTP, speculative_tokens=2, enable_eplb=True,
                         eplb_config=dict(num_redundant_experts=4, window_size=8, step_interval=4), **CHUNK)
    try:
        assert staggered(engine) == plain
        assert drafted(engine) == want and 0 < want[1] < want[0]
        eplb = engine.stats().eplb
        assert eplb.rebalances >= 2 and eplb.moved_experts > 0
        steps = [s.counters.steps for s in engine.rank_stats]
        alone = engine.add_request("alone", PROMPTS[2], LONG, rank=0)   # group 1 makes idle passes only
        assert [o for o in run_to_end(engine) if o.finished][0].token_ids == plain[2]
        ran = [s.counters.steps - b for s, b in zip(engine.rank_stats, steps)]
        assert ran[alone] > 0 and ran[1 - alone] == 0
        assert all(len(set(g)) == 1 for g in engine.cache_digests())
    finally:
        engine.close()


# ---- handoffs between layouts ------------------------------------------------------------------------
def test_handoffs_between_a_dp_pool_and_a_dp_x_tp_pool_equal_a_coldrun_to_end(dptp, tmp_path_factory):
    """Prefill on DP=2 rank 1 -> decode on DP=2 x TP=2 rank 1, and back, over NIXL (UCX on the CPU):
    the READ lands in the decode group's rank 0, which sends the bytes to its group."""
    name, path, _, _, engine = dptp
    dp = tiny_engine(path, name, **DP, swa_policy=engine.config.swa_policy)      # the same fingerprint
    agents = {}
    try:
        for key, e in (("dp", dp), ("dptp", engine)):
            agents[key] = e.open_nixl(f"test-dptp-{key}", "127.0.0.1", "UCX", 10.0)
            assert agents[key] is not None, "NIXL (UCX) must run here"
        cold = tiny_engine(path, name)
        ps = [random_prompt(7 * BLOCK_TOKENS[name] + 5, seed=s) for s in (61, 62)]
        want = cold.generate(ps, GREEDY)
        cold.close()
        for i, (src, dst) in enumerate(((dp, engine), (engine, dp))):
            rid, src_key = f"h{i}", "dp" if src is dp else "dptp"
            src.add_request(rid, ps[i], GREEDY, hold_kv=True, rank=1)
            first = [o for o in run_to_end(src) if o.request_id == rid][-1]
            held = src.held_handle(rid)
            offer = src.offer_held(rid, agents[src_key])
            assert offer.location.agent_name.endswith("-dp1")
            transports = {"nixl": agents["dptp" if src is dp else "dp"], "ray": GatheredTransport(dst.fingerprint)}
            loader = Loader(offer, transports, None,
                            {"nixl_bytes": 0, "ray_bytes": 0, "fallbacks": 0, "handoff_reused_blocks": 0,
                             "handoff_saved_bytes": 0})
            dst.add_request(rid, ps[i], GREEDY, resume=Resume(first.first, loader, first.cached_tokens, held.rng_state),
                            rank=1)
            done = [o for o in run_to_end(dst) if o.request_id == rid and o.finished][-1]
            assert done.token_ids == want[i].token_ids and loader.report.transport == "nixl"
            deadline = time.monotonic() + 10
            while src.is_held(rid) and time.monotonic() < deadline:
                src.release_read(agents[src_key])
                time.sleep(0.01)
            assert not src.is_held(rid)
        assert_groups_agree(engine)
    finally:
        dp.close()


# ---- start-up errors and failures ----------------------------------------------------------------------
@pytest.mark.parametrize("kw, overrides, numbers", [
    (dict(DP, tensor_parallel_size=4), None, ["data_parallel_size x tensor_parallel_size = 2 x 4 = 8",
                                              "n_routed_experts=4"]),
    (DPTP, dict(num_attention_heads=3, o_groups=1), ["tensor_parallel_size=2", "num_attention_heads=3", "o_groups=1"]),
    (dict(DPTP, enable_eplb=True, eplb_config=dict(num_redundant_experts=2)), None,
     ["num_redundant_experts=2", "2 x 2 = 4"]),
])
def test_sizes_that_do_not_split_the_model_fail_at_start_up_naming_the_numbers(tmp_path, kw, overrides, numbers):
    path = write_tiny_checkpoint(tmp_path, "swa_csa_hca", overrides=overrides)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        open_engine(EngineConfig(model=str(path), block_tokens=BLOCK_TOKENS["swa_csa_hca"], **kw))
    assert all(n in str(e.value) for n in numbers), str(e.value)
    assert time.monotonic() - t0 < 10


def test_a_killed_rank_of_a_group_fails_the_replica_quickly(tmp_path):
    """Rank 1 of DP rank 0's TP group killed mid-request: RankFailed within the timeout, the engine
    stays failed (a stalled rank times out in the same collectives: test_tensor_parallel's case)."""
    path = write_tiny_checkpoint(tmp_path, "swa_csa_hca")
    assert_rank_failure_is_quick(path, "swa_csa_hca", lambda e: e.local.ranks.launcher.procs[0].pid, ("kill",),
                                 **DPTP)


def test_fp8_blocks_a_cut_would_split_replicate_the_shared_expert_or_refuse_the_attention_by_name(tmp_path):
    """Blocks of 16 x 16 and a shared expert of intermediate 48: TP=2 would cut it at 24 rows, so
    the loader keeps it whole on every rank of a group (each runs it on its share of the tokens)
    and the replica still equals TP=1; in 128 x 128 blocks (as released) TP=2 would cut the
    attention's blocks, and start-up names the tensor."""
    dense = write_tiny_checkpoint(tmp_path / "dense", "swa_csa_hca", overrides=dict(moe_intermediate_size=48))
    q = quantize_checkpoint(dense, tmp_path / "q", block=(16, 16), scale_fmt="float", expert_dtype="fp8")
    ps = prompts("swa_csa_hca")["B"]
    ref = tiny_engine(q, "swa_csa_hca", dtype="float32").generate(ps, GREEDY)
    engine = tiny_engine(q, "swa_csa_hca", dtype="float32", **DPTP)
    try:
        assert engine.local.model.layers[0].ffn.shard.split_shared is False
        assert_same_outputs(engine.generate(ps, GREEDY), ref)
    finally:
        engine.close()
    released = quantize_checkpoint(write_tiny_checkpoint(tmp_path / "plain", "swa_csa_hca"), tmp_path / "released",
                                   block=(128, 128))
    with pytest.raises(Exception, match=r"tensor_parallel_size=2: layers\.0\.attn\.wo_a\.weight is quantized in "
                                        r"blocks of 128"):
        tiny_engine(released, "swa_csa_hca", dtype="float32", **DPTP)
