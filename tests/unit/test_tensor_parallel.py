"""Tensor / expert parallelism on the CPU (gloo): a TP=2 engine (rank 1 a spawned process)
equals the TP=1 engine, token for token, on every tiny config: batched, chunked, restored from
the store under each SWA policy, handed off across sizes, forked, speculated. The cache is
rank-invariant: what TP=2 stores, TP=1 restores, and the other way round. Bad sizes fail at
start-up; a rank that dies or stalls gives RankFailed, never a hang.

One TP=2 engine per (config, variant) for the whole module: starting one costs a process spawn."""
from __future__ import annotations

import time

import pytest

from tests.helpers import (BLOCK_TOKENS, TINY_CONFIGS, assert_rank_failure_is_quick, assert_same_outputs,
                           cold_references, random_prompt, stored_by_tp1, tiny_engine, write_tiny_checkpoint)
from tests.quant_checkpoint import quantize_checkpoint
from kvmesh.workers.checkpoint.loader import load_model
from kvmesh.workers.model.args import ConfigError
from kvmesh.workers.model.quant import QuantExperts
from kvmesh.workers.model.shard import Shard
from kvmesh.workers.request import Resume
from kvmesh.workers.sampling.params import SamplingParams
from kvmesh.workers.spec.speculative import OracleDrafter

pytestmark = pytest.mark.slow     # gloo process groups: rank 1 is a spawned process

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
FORKS = SamplingParams(max_tokens=6, temperature=0.8, n=2, seed=3, ignore_eos=True)
VARIANTS = {"tp2": False, "tp2_ep": True}                         # -> enable_expert_parallel
POLICIES = ["full", "periodic", "zero"]                           # each (config, variant) gets one, rotating


def policy(name: str, variant: str) -> str:
    kind = POLICIES[(sorted(TINY_CONFIGS).index(name) + list(VARIANTS).index(variant)) % 3]
    return f"periodic:{2 * BLOCK_TOKENS[name]}" if kind == "periodic" else kind


def prompts(name: str) -> dict[str, list[list[int]]]:
    """A: stored by TP=1 before the TP=2 engine starts; A_ext continues A's first 4 blocks.
    B: first run at TP=2; B_ext continues them (restored by a TP=1 engine)."""
    bt = BLOCK_TOKENS[name]
    a = [random_prompt(4 * bt + 5, seed=1), random_prompt(5 * bt + 1, seed=2)]
    b = [random_prompt(4 * bt + 3, seed=3), random_prompt(3 * bt, seed=4), random_prompt(7, seed=5)]
    ext = lambda ps, s: [p[:4 * bt] + random_prompt(9, seed=s + i) for i, p in enumerate(ps)]  # noqa: E731
    return {"A": a, "A_ext": ext(a, 10), "B": b, "B_ext": ext(b[:1], 20)}


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def checkpoint(request, tmp_path_factory):
    name = request.param
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(name), name)
    refs = cold_references(path, name, prompts(name), GREEDY, FORKS)     # TP=1, no store: the reference
    return name, path, refs


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tp2(request, checkpoint, tmp_path_factory):
    """(name, path, refs, store, TP=2 engine over a store TP=1 wrote A into)."""
    name, path, refs = checkpoint
    swa = policy(name, request.param)
    store = stored_by_tp1(path, name, str(tmp_path_factory.mktemp("store")), swa, prompts(name)["A"], GREEDY)
    engine = tiny_engine(path, name, tensor_parallel_size=2, enable_expert_parallel=VARIANTS[request.param],
                         swa_policy=swa, store=store, max_batched_tokens=3 * BLOCK_TOKENS[name] + 1)
    yield name, path, refs, store, engine
    engine.close()


def test_tp2_batched_chunked_and_restored_equals_tp1_and_tp1_restores_what_tp2_stored(tp2):
    name, path, refs, store, engine = tp2
    ps = prompts(name)
    out = engine.generate(ps["A_ext"] + ps["B"], GREEDY)      # A_ext from TP=1's store objects, B cold
    assert all(o.cached_tokens > 0 for o in out[:len(ps["A_ext"])])
    assert_same_outputs(out, refs["A_ext"] + refs["B"])
    engine.flush()
    reader = tiny_engine(path, name, swa_policy=engine.config.swa_policy, store=store)
    again = reader.generate(ps["B_ext"], GREEDY)              # B's blocks and state as TP=2 stored them
    assert all(o.cached_tokens > 0 for o in again)
    assert_same_outputs(again, refs["B_ext"])


def test_tp2_forks_and_speculative_rollback_equal_tp1(tp2):
    name, _, refs, _, engine = tp2
    ps = prompts(name)
    forks = engine.generate(ps["B"][:1], FORKS)
    assert [o.token_ids for o in forks] == [r.token_ids for r in refs["forks"]]
    wrong = {tuple(p): [t if i % 3 else (t + 1) % 300 for i, t in enumerate(r.token_ids)]
             for p, r in zip(ps["B"], refs["B"])}                 # every third draft rejected: ring rollback
    engine.set_drafter(OracleDrafter(wrong), k=3)
    try:
        spec = engine.generate(ps["B"], GREEDY)
    finally:
        engine.set_drafter(None)
    assert engine.counters.draft_tokens > engine.counters.accepted_draft_tokens > 0
    assert_same_outputs(spec, refs["B"])


def _handoff(prefill, decode, prompt, rid, reused=None):
    """Hand `prompt` over; `reused` (a list) gets how many leading blocks decode already held."""
    prefill.add_request(rid, prompt, GREEDY, hold_kv=True)
    first = [o for o in _run(prefill) if o.request_id == rid][-1]
    assert first.finish_reason == "held"
    payload = prefill.export_held(rid)
    prefill.release_held(rid)

    def load(cache, blocks, slot, held):
        (reused if reused is not None else []).append(held)
        cache.scatter(blocks[held:], slot, cache.skip_blocks(payload, held))
    decode.add_request(rid, prompt, GREEDY, resume=Resume(first.first, load, first.cached_tokens))
    return [o for o in _run(decode) if o.finished][-1]


def _run(e):
    outs = []
    while e.has_unfinished():
        outs += e.step()
    return outs


def test_handoff_from_tp2_to_tp1_and_back_equals_tp1(tp2):
    name, path, refs, _, engine = tp2
    ps, tp1 = prompts(name), tiny_engine(path, name, swa_policy=engine.config.swa_policy)   # same layout
    assert _handoff(engine, tp1, ps["B"][0], "to-tp1").token_ids == refs["B"][0].token_ids
    assert _handoff(tp1, engine, ps["B"][1], "to-tp2").token_ids == refs["B"][1].token_ids
    # TP=2 decode now holds B[1]'s blocks on both ranks: a repeat loads (and mirrors) only the rest + the slot
    reused = []
    assert _handoff(tp1, engine, ps["B"][1], "to-tp2-again", reused).token_ids == refs["B"][1].token_ids
    assert reused == [len(ps["B"][1]) // engine.config.block_tokens] and reused[0] > 0


# ---- start-up errors (no ranks are started for these) --------------------------------------------
@pytest.mark.parametrize("size, ep, numbers", [
    (3, False, ["num_attention_heads=4", "o_groups=2", "vocab_size=300", "moe_intermediate_size=32"]),
    (8, True, ["num_attention_heads=4", "n_routed_experts=4"]),
    (0, False, ["tensor_parallel_size", "> 0"]),
])
def test_a_size_that_does_not_divide_the_model_fails_at_start_up_naming_the_numbers(tmp_path, size, ep, numbers):
    path = write_tiny_checkpoint(tmp_path, "swa_csa_hca")
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        tiny_engine(path, "swa_csa_hca", tensor_parallel_size=size, enable_expert_parallel=ep)
    assert all(n in str(e.value) for n in numbers), str(e.value)
    assert time.monotonic() - t0 < 10


def test_quantized_weights_shard_with_their_scale_blocks_or_fail_naming_the_tensor(tmp_path):
    dense = write_tiny_checkpoint(tmp_path / "dense", "swa_csa_hca")
    small = quantize_checkpoint(dense, tmp_path / "small", block=(16, 16), scale_fmt="float", expert_dtype="fp4")
    with pytest.raises(ConfigError, match=r"experts\.w2 .*blocks of 16.*enable-expert-parallel"):
        load_model(small, shard=Shard(0, 2, expert_parallel=False))   # FP4 w2: 16 inputs per rank < 32
    _, model = load_model(small, shard=Shard(1, 2, expert_parallel=True))
    experts = model.layers[1].ffn.experts
    assert isinstance(experts, QuantExperts) and experts.w1.shape[0] == 2 and experts.first == 2
    big = quantize_checkpoint(dense, tmp_path / "big", block=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4")
    with pytest.raises(ConfigError, match=r"attn\.(wq_b|wo_a)\.weight is quantized in blocks of 128.*cannot be split"):
        load_model(big, shard=Shard(0, 2, expert_parallel=True))


def test_quantized_tp2_with_expert_parallel_equals_tp1(tmp_path):
    dense = write_tiny_checkpoint(tmp_path / "dense", "swa_csa_hca")
    q = quantize_checkpoint(dense, tmp_path / "q", block=(16, 16), scale_fmt="float", expert_dtype="fp4")
    ps = prompts("swa_csa_hca")["B"]
    ref = tiny_engine(q, "swa_csa_hca", dtype="float32").generate(ps, GREEDY)   # fp32: sums in another order
    engine = tiny_engine(q, "swa_csa_hca", dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        assert_same_outputs(engine.generate(ps, GREEDY), ref)
    finally:
        engine.close()


# ---- failures -----------------------------------------------------------------------------------
def test_a_stalled_or_killed_rank_gives_rank_failed_quickly_never_a_hang(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "swa_csa_hca")
    assert_rank_failure_is_quick(path, "swa_csa_hca", lambda e: e.ranks.launcher.procs[0].pid, tensor_parallel_size=2)


def test_rank_zeros_store_listens_on_its_host_address_only():
    """TCPStore binds every interface by itself; rank 0's store listens on the address it names
    (on a loopback-only `kvmesh serve`, 127.0.0.1) and the ranks still reach it there."""
    import datetime
    import os

    import psutil
    import torch.distributed as dist

    from kvmesh.workers.parallel.collectives import Collectives, init_method, parse_init_method
    store = Collectives.host_store("127.0.0.1", 2, 30)
    listening = {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet")
                 if c.pid == os.getpid() and c.status == psutil.CONN_LISTEN and c.laddr.port == store.port}
    assert listening == {("127.0.0.1", store.port)}
    host, port = parse_init_method(init_method("127.0.0.1", store))
    client = dist.TCPStore(host, port, 2, is_master=False, timeout=datetime.timedelta(seconds=30))
    client.set("k", "v")
    assert store.get("k") == b"v"
