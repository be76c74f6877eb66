"""`kvmesh plan` and workers/checkpoint/sizing.py: weights per rank, KV bytes per token, tokens that fit,
the TP/DP/EP sizes that divide the model; numbers checked by hand on the tiny config and against
the released V4 shapes."""
from __future__ import annotations

import json
import math

import pytest

from kvmesh.cluster.cli import main
from tests.helpers import TINY_BASE, TINY_CONFIGS, write_tiny_checkpoint
from tests.quant_checkpoint import quantize_checkpoint
from kvmesh.workers.checkpoint.released import RELEASED_CONFIGS
from kvmesh.workers.checkpoint.sizing import (
    GiB,
    SizingError,
    format_plan,
    parallel_problems,
    parse_nodes,
    plan,
    split_from_checkpoint,
    split_from_config,
)
from kvmesh.workers.model.args import ModelArgs

NAME = "swa_csa_hca"
TINY = {"model_type": "deepseek_v4", **TINY_BASE, **TINY_CONFIGS[NAME], "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("dense"), NAME)


def test_tiny_weight_split_by_hand():
    """float32; vocab 300, hidden 64, 4 heads x 32, q_lora 32, 2 output groups x o_lora 16,
    4 routed experts x intermediate 32 (and one shared), 3 layers."""
    split = split_from_config(ModelArgs.from_dict(TINY))
    per_layer = 32 * 4 * 32 + 4 + (4 * 32 // 2) * (2 * 16) + (2 * 16) * 64 + 3 * 64 * 32   # wq_b sink wo_a wo_b shared
    assert split.tensor == 4 * (3 * per_layer + 2 * 300 * 64)                                # + embed, head
    assert split.experts == 4 * 3 * (3 * 4 * 32 * 64)                                     # w1 w2 w3 x 4 experts
    assert split.per_rank(2) == split.replicated + split.tensor // 2 + split.experts // 2
    assert split.per_rank(1) == split.total
    # data-parallel attention: attention, embedding and head whole on every rank, experts split over all
    assert split.per_rank(1, 4) == split.replicated + split.tensor + split.experts // 4
    # TP inside DP ranks: attention and the shared expert split by the DP rank's TP group
    assert split.per_rank(2, 2) == split.replicated + split.tensor // 2 + split.experts // 4


def test_weights_from_config_equal_the_checkpoints_headers(dense_dir):
    """The meta-device count from config.json alone agrees with the safetensors headers
    (transformers declares an MTP layer in config.json but saves none)."""
    from_config = split_from_config(ModelArgs.from_file(dense_dir / "config.json"), mtp_layers=0)
    from_files = split_from_checkpoint(dense_dir)
    assert (from_config.replicated, from_config.tensor, from_config.experts, from_config.params) == \
           (from_files.replicated, from_files.tensor, from_files.experts, from_files.params)


@pytest.mark.parametrize("fmt", [dict(block=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4"),
                                 dict(block=(16, 32), scale_fmt="float", expert_dtype="fp8")],
                         ids=["ue8m0_fp4", "fp32_fp8_experts"])
def test_quantized_sizes_from_config_equal_the_released_format(dense_dir, tmp_path, fmt):
    """FP8 linears with block scales, FP4 (or FP8) experts, BF16 embeddings / router /
    compressors, FP32 norms, one MTP layer: counted as stored, from config.json alone."""
    quant = quantize_checkpoint(dense_dir, tmp_path / "q", **fmt)
    from_config = split_from_config(ModelArgs.from_file(quant / "config.json"))
    from_files = split_from_checkpoint(quant)
    assert from_files.mtp_params > 0 and from_config.mtp_params == from_files.mtp_params
    assert (from_config.replicated, from_config.tensor, from_config.experts, from_config.params) == \
           (from_files.replicated, from_files.tensor, from_files.experts, from_files.params)
    dense = split_from_config(ModelArgs.from_file(dense_dir / "config.json"), mtp_layers=1)
    assert from_config.experts < dense.experts * (0.3 if fmt["expert_dtype"] == "fp4" else 0.5)


def test_tiny_plan_by_hand():
    a = ModelArgs.from_dict(TINY)
    split = split_from_config(a)
    p = plan(a, split, 0.004, 4, block_tokens=16, swa_policy="zero", context=100, reserve=0.25)
    # compressed KV per token, float32: CSA (16/4 entries x (32 + 16)) + HCA (16/16 x 32), per 16 tokens
    block = (16 // 4) * (32 + 16) * 4 + (16 // 16) * 32 * 4
    assert p.block_bytes == block and p.kv_bytes_per_token == block / 16 == 56
    # TP sizes (with / without EP), then DP sizes with EP whose tp x dp divides 4 experts, by ranks;
    # TP 4 inside a DP rank is left out (o_groups 2)
    assert [(f.tp, f.dp, f.expert_parallel) for f in p.fits] == [
        (1, 1, False), (2, 1, False), (2, 1, True), (1, 2, True),
        (4, 1, False), (4, 1, True), (2, 2, True), (1, 4, True)]
    for f in p.fits:
        free = int(0.004 * GiB * 0.75) - split.per_rank(f.tp, f.dp)
        blocks = (free - p.layout.slot_bytes) // block              # on one rank
        assert (f.free_per_rank, f.tokens, f.max_context) == (free, f.dp * blocks * 16, min(4096, blocks * 16))
        assert f.requests_at_context == f.dp * (free // (math.ceil(100 / 16) * block + p.layout.slot_bytes))
        assert f.replicas_per_node == 4 // (f.tp * f.dp) and f.tokens_per_node == f.tokens * f.replicas_per_node
        assert f.fits == (f.tp <= 2)       # o_groups 2
    full = plan(a, split, 0.004, 4, block_tokens=16, swa_policy="full")
    assert full.block_bytes > p.block_bytes           # blocks also hold the SWA K=V under `full`


def test_sizes_that_do_not_divide_the_model_are_named():
    a = ModelArgs.from_dict(TINY)
    assert parallel_problems(a, 2, True) == []
    assert parallel_problems(a, 3, False) == [
        "num_attention_heads 4 is not divisible by tensor_parallel_size 3",
        "o_groups 2 is not divisible by tensor_parallel_size 3",
        "moe_intermediate_size 32 is not divisible by tensor_parallel_size 3"]
    assert parallel_problems(a, 8, True)[-1] == "n_routed_experts 4 is not divisible by tensor_parallel_size 8"
    # data-parallel attention splits only the experts, over all the replica's ranks
    assert parallel_problems(a, 1, True, dp=4) == []
    assert parallel_problems(a, 1, True, dp=3) == ["n_routed_experts 4 is not divisible by data_parallel_size 3"]
    assert parallel_problems(a, 2, True, dp=4) == [
        "n_routed_experts 4 is not divisible by tensor_parallel_size x data_parallel_size 2 x 4 = 8"]


def test_released_shapes_have_their_published_sizes():
    """V4-Flash 284 B parameters, V4-Pro 1.6 T (the model cards), plus one MTP layer each;
    V4-Pro's compressed KV is 9,848 B/token in bf16 (DESIGN §1)."""
    flash, pro = ({n: split_from_config(ModelArgs.from_dict(RELEASED_CONFIGS[n])) for n in ("V4-Flash", "V4-Pro")}
                  .values())
    assert round((flash.params - flash.mtp_params) / 1e9) == 284
    assert round(pro.params / 1e12, 1) == 1.6
    a = ModelArgs.from_dict(RELEASED_CONFIGS["V4-Pro"])
    p = plan(a, pro, 141, 8, swa_policy="zero")
    assert p.kv_bytes_per_token == 9848
    fits = {(f.tp, f.dp, f.expert_parallel): f for f in p.fits}
    assert fits[(8, 1, True)].fits and not fits[(4, 1, True)].fits and not fits[(1, 1, False)].fits
    assert fits[(6, 1, True)].problems and "num_attention_heads 128" in fits[(6, 1, True)].problems[0]


def test_plan_cli_for_a_released_shape_and_a_checkpoint(dense_dir, capsys):
    assert main(["plan", "--config", "V4-Pro", "--gpu-memory", "141", "--gpus", "8", "--swa-policy", "zero"]) == 0
    out = capsys.readouterr().out
    assert "9,848.0 B/token compressed" in out and "1,598.8 B parameters" in out
    rows = {tuple(line.split()[:3]): line for line in out.splitlines() if line[:1].isdigit()}
    assert rows[("8", "1", "on")].endswith("yes") and rows[("1", "1", "off")].endswith("weights exceed the device")
    assert rows[("3", "1", "on")].endswith("no: TP does not divide num_attention_heads 128, o_groups 16, "
                                           "vocab_size 129280")
    assert rows[("1", "8", "on")].endswith("yes") and rows[("2", "4", "on")].endswith("yes")
    assert main(["plan", "--model", str(dense_dir), "--gpu-memory", "1", "--gpus", "2", "--json",
                 "--kv-cache-dtype", "fp8", "--block-tokens", "16"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["weight_bytes"] == split_from_checkpoint(dense_dir).total
    assert [(s["tp"], s["dp"], s["expert_parallel"]) for s in got["sizes"]] == [
        (1, 1, False), (2, 1, False), (2, 1, True), (1, 2, True)] and all(s["fits"] for s in got["sizes"])
    dp2 = got["sizes"][-1]
    assert dp2["replicas_per_node"] == 1 and dp2["tokens"] == dp2["tokens_per_node"] > 1.9 * got["sizes"][0]["tokens"]


def _per_node(p, tp: int, dp: int) -> int:
    return next(f.tokens_per_node for f in p.fits if (f.tp, f.dp, f.expert_parallel) == (tp, dp, True))


def test_dp8_ep8_holds_7x_the_kv_of_tp8_on_v4_flash():
    """vLLM measured 7.7x on V4-Flash (8 x H200, FP8 KV): each DP rank holds its own cache and only
    1/8 of the routed experts, and the 8.4 GiB of attention / embedding / shared expert it replicates
    cost little of the 127 GiB a rank can use."""
    a = ModelArgs.from_dict(RELEASED_CONFIGS["V4-Flash"])
    for policy in ("full", "zero"):
        p = plan(a, split_from_config(a), 141, 8, kv_cache_dtype="fp8", swa_policy=policy)
        assert 7 <= _per_node(p, 1, 8) / _per_node(p, 8, 1) < 8, policy


def test_v4_pro_dp8_is_weight_bound_on_one_141_gib_node():
    """V4-Pro's 27.2 GiB of attention (19.2), embedding, head and shared experts, whole on each of 8
    ranks next to 1/8 of its 778 GiB of experts, leave 2.5 GiB a rank for KV: DP8 holds less than TP8
    (23.2 GiB on one shared cache); TP2 inside each of 4 DP ranks is the best split of one node."""
    a = ModelArgs.from_dict(RELEASED_CONFIGS["V4-Pro"])
    p = plan(a, split_from_config(a), 141, 8, kv_cache_dtype="fp8")
    tp8 = _per_node(p, 8, 1)
    assert _per_node(p, 1, 8) < tp8 < _per_node(p, 4, 2) < _per_node(p, 2, 4)
    assert 2 < _per_node(p, 2, 4) / tp8 < 3


def test_tiny_replicas_over_several_nodes_by_hand():
    """2 devices a node, 4 experts: over 2 nodes a replica has 4 ranks (TP 2 x DP 2, or DP 4), sized
    as one node's DP rows are; over 3 nodes 6 ranks do not divide 4 experts, so no rows."""
    a = ModelArgs.from_dict(TINY)
    split = split_from_config(a)
    one = plan(a, split, 0.004, 2, block_tokens=16, swa_policy="zero", context=100, reserve=0.25)
    p = plan(a, split, 0.004, 2, block_tokens=16, swa_policy="zero", context=100, reserve=0.25, nodes=3)
    assert p.fits[:len(one.fits)] == one.fits and all(f.nodes == 1 for f in one.fits)
    multi = p.fits[len(one.fits):]
    assert [(f.tp, f.dp, f.nodes, f.dp_local) for f in multi] == [(2, 2, 2, 1), (1, 4, 2, 2)]
    for f in multi:
        free = int(0.004 * GiB * 0.75) - split.per_rank(f.tp, f.dp)
        blocks = (free - p.layout.slot_bytes) // p.block_bytes
        assert f.expert_parallel and f.fits and f.weights_per_rank == split.per_rank(f.tp, f.dp)
        assert (f.free_per_rank, f.tokens, f.tokens_per_node) == (free, f.dp * blocks * 16, f.dp * blocks * 16 // 2)
        assert f.replicas_per_node == 0.5
    assert one.nodes == 1 and p.nodes == 3 and not p.auto_nodes
    # auto: something fits on one node, so one node's rows only
    assert plan(a, split, 0.004, 2, block_tokens=16, swa_policy="zero", nodes=None).fits == \
        plan(a, split, 0.004, 2, block_tokens=16, swa_policy="zero").fits
    # auto where nothing fits on 1 or 2 nodes (4 experts: 2 nodes of 2 at most): one node's rows, and says so
    none = plan(a, split, 0.0001, 2, block_tokens=16, swa_policy="zero", nodes=None)
    assert none.nodes == 2 and all(f.nodes == 1 and not f.fits for f in none.fits)
    assert "no size fits on one node, nor over up to 2 nodes of 2" in format_plan(none, "tiny")


@pytest.fixture(scope="module")
def pro():
    a = ModelArgs.from_dict(RELEASED_CONFIGS["V4-Pro"])
    return a, split_from_config(a)


@pytest.mark.parametrize("gib", [80, 96], ids=["H100", "H20"])
def test_v4_pro_fits_8_x_80_and_96_gib_only_over_two_nodes(pro, gib):
    """805 GiB of weights fit no 8-device node of 80 or 96 GiB at any size; over two whole nodes, 16
    ranks hold 1/16 of the 778 GiB of experts each (48.6 GiB) beside the attention they replicate
    or split by TP; auto stops at the fewest nodes where a row fits."""
    a, split = pro
    single = plan(a, split, gib, 8, kv_cache_dtype="fp8", nodes=1)
    assert single.fits and not any(f.fits for f in single.fits) and all(f.nodes == 1 for f in single.fits)
    p = plan(a, split, gib, 8, kv_cache_dtype="fp8", nodes=None)
    assert p.fits[:len(single.fits)] == single.fits and p.nodes == 2 and p.auto_nodes
    multi = {(f.tp, f.dp): f for f in p.fits if f.nodes > 1}
    assert set(multi) == {(8, 2), (4, 4), (2, 8), (1, 16)} and all(f.nodes == 2 for f in multi.values())
    fitting = [f for f in multi.values() if f.fits]
    assert multi[(8, 2)].fits and all(f.tokens > 0 and f.tokens_per_node == f.tokens // 2 for f in fitting)
    assert all(f.dp_local == 8 // f.tp and f.weights_per_rank == split.per_rank(f.tp, f.dp) for f in fitting)
    assert multi[(1, 16)].fits == (gib == 96)     # 27.2 GiB replicated + 48.6 of experts > 72 GiB usable of 80
    # a wider replica holds more: 4 nodes at TP8 beat 2 nodes per node
    wide = plan(a, split, gib, 8, kv_cache_dtype="fp8", nodes=4)
    per_node = {f.nodes: f.tokens_per_node for f in wide.fits if f.tp == 8 and f.nodes > 1}
    assert sorted(per_node) == [2, 3, 4] and per_node[2] < per_node[3] < per_node[4]


def test_plan_cli_json_has_multi_node_rows_that_fit_for_v4_pro_on_8_x_80_gib(capsys):
    """Issue 29's done-when: the default (--nodes auto) finds the two-node layouts."""
    assert main(["plan", "--config", "V4-Pro", "--gpu-memory", "80", "--gpus", "8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["nodes"] == 2 and got["gpus_per_node"] == 8
    fits = [s for s in got["sizes"] if s["fits"]]
    assert fits and all(s["nodes"] == 2 and s["served"] and s["expert_parallel"] for s in fits)
    assert all(s["tokens_per_node"] * 2 == s["tokens"] > 0 and s["replicas_per_node"] == 0.5 for s in fits)
    assert all(s["data_parallel_size_local"] * s["tp"] == 8 for s in fits)
    assert not any(s["fits"] for s in got["sizes"] if s["nodes"] == 1)
    assert main(["plan", "--config", "V4-Pro", "--gpu-memory", "80", "--gpus", "8", "--nodes", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:1].isdigit()]
    assert rows and all(line.split()[3] == "1" and "no:" in line for line in rows)


def test_parse_nodes():
    assert (parse_nodes("auto"), parse_nodes(None), parse_nodes("3"), parse_nodes(2)) == (None, None, 3, 2)
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(SizingError, match="--nodes must be a whole number >= 1 or auto"):
            parse_nodes(bad)


@pytest.mark.parametrize("argv,message", [
    (["--config", "V4-Pro", "--gpu-memory", "80", "--gpus", "8", "--nodes", "0"],
     "--nodes must be a whole number >= 1 or auto (got '0')"),
    (["--config", "V4-Pro", "--gpu-memory", "80", "--gpus", "8", "--nodes", "two"], "got 'two'"),
    (["--config", "nowhere.json", "--gpu-memory", "80", "--gpus", "8"], "config.json not found"),
    (["--config", "V4-Pro", "--gpu-memory", "0", "--gpus", "8"], "--gpu-memory > 0"),
    (["--config", "V4-Pro", "--gpu-memory", "80", "--gpus", "8", "--block-tokens", "100"], "multiple of"),
])
def test_plan_with_bad_inputs_exits_2_with_a_message(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("raw", [TINY, RELEASED_CONFIGS["V4-Flash"], RELEASED_CONFIGS["V4-Pro"]],
                         ids=["tiny", "V4-Flash", "V4-Pro"])
def test_plan_and_the_engine_agree_on_which_sizes_divide_the_model(raw):
    from kvmesh.workers.checkpoint.sharding import check_sizes
    from kvmesh.workers.model.args import ConfigError
    a = ModelArgs.from_dict(raw)
    for tp in range(1, 17):
        for ep in (False, True):
            try:
                check_sizes(a, tp, ep)
                engine_ok = True
            except ConfigError:
                engine_ok = False
            assert engine_ok == (parallel_problems(a, tp, ep) == []), (tp, ep)
