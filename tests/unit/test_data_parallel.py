"""Data-parallel attention with expert parallelism on the CPU (gloo): a DP=2+EP engine (rank 1 a
spawned process with its own scheduler and cache, half the routed experts on each rank) equals
the TP=1 engine, token for token and logprobs within 1e-4, on every tiny config and on one whose
head / output-group counts tensor parallelism cannot split: batched, chunked, restored from the
store under each SWA policy, with ranks' batches of different sizes and one rank idle. On every
tiny config the DP=2 engine runs EPLB with redundant experts, rebalancing every few steps in the
middle of generation (weights moving between the ranks), so each check is also EPLB = no EPLB;
the odd config runs without EPLB. The front
routes a repeated prompt to the rank that holds it; what DP=2 stores TP=1 restores and the other
way round. Bad sizes fail at start-up naming the numbers; a dead or stalled rank is RankFailed.

One DP=2 engine per config for the whole module: starting one costs a process spawn."""
from __future__ import annotations

import time

import pytest

from tests.helpers import (BLOCK_TOKENS, TINY_CONFIGS, assert_rank_failure_is_quick, assert_same_outputs,
                           cold_references, random_prompt, stored_by_tp1, tiny_engine, write_tiny_checkpoint)
from tests.quant_checkpoint import quantize_checkpoint
from kvmesh.workers.checkpoint.sharding import check_sizes
from kvmesh.workers.engine import EngineProtocol
from kvmesh.workers.model.args import ConfigError, ModelArgs
from kvmesh.workers.model.quant import QuantExperts
from kvmesh.workers.sampling.params import InvalidRequestError, SamplingParams

pytestmark = pytest.mark.slow     # gloo process groups: rank 1 is a spawned process

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
FORKS = SamplingParams(max_tokens=6, temperature=0.8, n=2, seed=3, ignore_eos=True)
DP = dict(data_parallel_size=2, enable_expert_parallel=True)
ODD = "odd_heads"                       # swa_csa_hca with 3 heads in 1 output group: TP=2 cannot split it
CONFIGS = {**{n: (n, None) for n in TINY_CONFIGS}, ODD: ("swa_csa_hca", dict(num_attention_heads=3, o_groups=1))}
EPLB = {"swa_csa_hca": 2, "csa_hca_odd_window": 4, "hca_yarn_wide_window": 2}      # redundant experts
POLICIES = {"swa_csa_hca": "full", "csa_hca_odd_window": "periodic", "hca_yarn_wide_window": "zero", ODD: "periodic"}


def policy(case: str) -> str:
    bt = BLOCK_TOKENS[CONFIGS[case][0]]
    return f"periodic:{2 * bt}" if POLICIES[case] == "periodic" else POLICIES[case]


def prompts(name: str) -> dict[str, list[list[int]]]:
    """A: stored by TP=1 before the DP=2 engine starts; A_ext continues A's first 4 blocks.
    B: first run at DP=2 (five prompts: three on one rank, two on the other); B_ext continues B[0].
    idle: run alone at DP=2."""
    bt = BLOCK_TOKENS[name]
    a = [random_prompt(4 * bt + 5, seed=1), random_prompt(5 * bt + 1, seed=2)]
    b = [random_prompt(4 * bt + 3, seed=3), random_prompt(3 * bt, seed=4), random_prompt(7, seed=5),
         random_prompt(2 * bt + 1, seed=6), random_prompt(11, seed=7)]
    ext = lambda ps, s: [p[:4 * bt] + random_prompt(9, seed=s + i) for i, p in enumerate(ps)]  # noqa: E731
    return {"A": a, "A_ext": ext(a, 10), "B": b, "B_ext": ext(b[:1], 20), "idle": [random_prompt(2 * bt + 3, seed=50)]}


def eplb(case: str, step_interval: int = 3) -> dict:
    if case not in EPLB:
        return {}
    return dict(enable_eplb=True, eplb_config=dict(num_redundant_experts=EPLB[case], window_size=8,
                                                   step_interval=step_interval))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def dp2(request, tmp_path_factory):
    """(case, name, path, refs, store, DP=2 engine over a store TP=1 wrote A into)."""
    case = request.param
    name, overrides = CONFIGS[case]
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(case), name, overrides=overrides)
    refs = cold_references(path, name, prompts(name), GREEDY, FORKS)     # TP=1, no store: the reference
    store = stored_by_tp1(path, name, str(tmp_path_factory.mktemp("store")), policy(case), prompts(name)["A"], GREEDY)
    engine = tiny_engine(path, name, **DP, swa_policy=policy(case), store=store,
                         max_batched_tokens=3 * BLOCK_TOKENS[name] + 1, **eplb(case))
    yield case, name, path, refs, store, engine
    engine.close()


def test_dp2_batched_chunked_and_restored_equals_tp1_and_tp1_restores_what_dp2_stored(dp2):
    case, name, path, refs, store, engine = dp2
    ps = prompts(name)
    out = engine.generate(ps["A_ext"] + ps["B"], GREEDY)      # A_ext from TP=1's store objects, B cold
    assert all(o.cached_tokens > 0 for o in out[:len(ps["A_ext"])])
    assert_same_outputs(out, refs["A_ext"] + refs["B"])
    if case in EPLB:       # rebalanced while these ran, experts moved: the tokens above are still TP=1's
        e = engine.stats().eplb
        assert e.rebalances >= 2 and e.moved_experts > 0 and e.imbalance >= 1.0
    prompt_tokens = [s.counters.prompt_tokens for s in engine.rank_stats]
    assert all(prompt_tokens) and prompt_tokens[0] != prompt_tokens[1]         # both ranks, batches differ
    total = engine.stats()                                    # the replica's: every rank's summed
    assert total.counters.prompt_tokens == sum(prompt_tokens) and total.load == 0 and total.restoring == 0
    assert total.total_blocks == sum(s.total_blocks for s in engine.rank_stats)
    assert total.reuse.query_tokens == sum(s.reuse.query_tokens for s in engine.rank_stats) > 0
    engine.flush()
    reader = tiny_engine(path, name, swa_policy=engine.config.swa_policy, store=store)
    again = reader.generate(ps["B_ext"], GREEDY)              # B's blocks and state as a DP rank stored them
    assert all(o.cached_tokens > 0 for o in again)
    assert_same_outputs(again, refs["B_ext"])


def test_the_data_parallel_front_is_an_engine_protocol(dp2):
    engine = dp2[-1]
    assert isinstance(engine, EngineProtocol) and len(engine.rank_stats) == 2


def test_one_rank_idle_serves_the_other_ranks_experts(dp2):
    *_, refs, _, engine = dp2
    name = dp2[1]
    steps = [s.counters.steps for s in engine.rank_stats]
    rank = engine.add_request("alone", prompts(name)["idle"][0], GREEDY)   # one request: the other rank
    one = [o for o in _run(engine) if o.finished]                         # only joins the exchanges
    assert_same_outputs(one, refs["idle"])
    ran = [s.counters.steps - b for s, b in zip(engine.rank_stats, steps)]
    assert ran[rank] > 0 and ran[1 - rank] == 0


def test_a_repeated_prompt_goes_to_the_rank_that_holds_it_and_forks_stay_on_one_rank(dp2):
    *_, refs, _, engine = dp2
    name = dp2[1]
    bt = BLOCK_TOKENS[name]
    prompt = random_prompt(6 * bt + 2, seed=40)
    other = engine.add_request("fill", random_prompt(2 * bt, seed=41), GREEDY)   # a load on one rank
    first = engine.add_request("p1", prompt, GREEDY)
    assert (other, first) == (0, 1)                              # least loaded (ties: the lower rank)
    outs = {o.request_id: o for o in _run(engine) if o.finished}
    assert outs["p1"].cached_tokens == 0
    loads = [engine.add_request(f"load{i}", random_prompt(2 * bt, seed=42 + i), GREEDY) for i in range(2)]
    assert sorted(loads) == [0, 1]                              # equal loads: a tie would go to rank 0
    again = engine.add_request("p2", prompt, GREEDY)
    assert again == first                                       # the rank holding the prefix
    outs.update({o.request_id: o for o in _run(engine) if o.finished})
    assert outs["p2"].cached_tokens > 0 and outs["p2"].token_ids == outs["p1"].token_ids
    forks = engine.generate(prompts(name)["B"][:1], FORKS)
    assert [o.token_ids for o in forks] == [r.token_ids for r in refs["forks"]]


def test_a_rank_hint_is_honoured_and_checked(dp2):
    """The serving path's hint (the ingress saw that rank hold the prefix) overrides the front's choice."""
    *_, refs, _, engine = dp2
    prompt = prompts(dp2[1])["idle"][0]
    assert engine.add_request("hinted", prompt, GREEDY, rank=1) == 1        # idle ranks: the front would take 0
    assert_same_outputs([o for o in _run(engine) if o.finished], refs["idle"])
    with pytest.raises(InvalidRequestError, match="rank 2: this engine has data-parallel ranks 0..1"):
        engine.add_request("bad", prompt, GREEDY, rank=2)


def _run(engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


# ---- start-up errors (no ranks are started for these) --------------------------------------------
@pytest.mark.parametrize("kw, numbers", [
    (dict(data_parallel_size=3, enable_expert_parallel=True), ["data_parallel_size=3", "n_routed_experts=4"]),
    (dict(data_parallel_size=2), ["data_parallel_size=2", "enable_expert_parallel"]),
    (dict(data_parallel_size=0), ["data_parallel_size", "> 0"]),
])
def test_a_size_or_combination_not_built_fails_at_start_up_naming_the_numbers(tmp_path, kw, numbers):
    path = write_tiny_checkpoint(tmp_path, "swa_csa_hca")
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        tiny_engine(path, "swa_csa_hca", **kw)
    assert all(n in str(e.value) for n in numbers), str(e.value)
    assert time.monotonic() - t0 < 10


def test_the_odd_config_is_one_tensor_parallelism_cannot_split(tmp_path):
    name, overrides = CONFIGS[ODD]
    path = write_tiny_checkpoint(tmp_path, name, overrides=overrides)
    with pytest.raises(ConfigError, match="num_attention_heads=3"):
        check_sizes(ModelArgs.from_file(path / "config.json"), 2, True)


def test_released_format_weights_at_dp2_equal_tp1_where_tp2_cannot_split_them(tmp_path):
    """FP8 linears in 128x128 blocks (as released) + FP4 experts: TP=2 would cut a scale block of
    the attention; DP=2 keeps attention whole and reads only its own experts (and their scales),
    here with EPLB: one redundant slot per rank, FP4 bytes + scales moved by rebalances, placed
    hierarchically as over two nodes (data_parallel_size_local 1: a rank per node)."""
    dense = write_tiny_checkpoint(tmp_path / "dense", "swa_csa_hca")
    q = quantize_checkpoint(dense, tmp_path / "q", block=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4")
    ps = prompts("swa_csa_hca")["B"]
    ref = tiny_engine(q, "swa_csa_hca", dtype="float32").generate(ps, GREEDY)
    engine = tiny_engine(q, "swa_csa_hca", dtype="float32", **DP, **eplb("swa_csa_hca", step_interval=2),
                         data_parallel_size_local=1)
    try:
        assert engine.local.balancer.num_nodes == 2
        experts = engine.local.model.layers[1].ffn.experts
        assert isinstance(experts, QuantExperts) and experts.w1.shape[0] == 3 and experts.first == 0
        assert_same_outputs(engine.generate(ps, GREEDY), ref)
        assert engine.stats().eplb.rebalances >= 2
    finally:
        engine.close()


# ---- failures -----------------------------------------------------------------------------------
def test_a_stalled_or_killed_rank_gives_rank_failed_quickly_never_a_hang(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "swa_csa_hca")        # a request on rank 0: rank 1 only exchanges
    assert_rank_failure_is_quick(path, "swa_csa_hca", lambda e: e.launcher.procs[0].pid, **DP)
