"""Released-format checkpoints (FP8 linears, FP4/FP8 experts, BF16 compressor/indexer, MTP
layers, ue8m0 `.scale` or fp32 `weight_scale_inv`) load as shipped, stay quantized in memory,
and generate exactly what transformers generates from the same files."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import assert_same_run, random_prompt, reference_greedy, write_tiny_checkpoint
from tests.quant_checkpoint import quantize_checkpoint
from kvmesh.workers.checkpoint.loader import CheckpointError, load_model
from kvmesh.workers.engine import Engine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.model.quant import FP8Linear, QuantExperts
from kvmesh.workers.request import Resume
from kvmesh.workers.sampling.params import SamplingParams

NAME, BT = "swa_csa_hca", 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TOL = 2e-4
FORMATS = {
    # V4-Flash as shipped: ue8m0 `.scale`, 128x128 blocks (one ceil-divided block per tiny weight),
    # FP4 experts, expert_dtype at the top level
    "ue8m0_fp4": dict(block=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4"),
    # V3-style fp32 `weight_scale_inv`, 16x16 blocks (many per weight), expert_dtype in quantization_config (V4.1)
    "fp32_fp4_small_blocks": dict(block=(16, 16), scale_fmt="float", expert_dtype="fp4",
                                  expert_dtype_in_quant_config=True),
    # FP8 experts with block scales
    "ue8m0_fp8_experts": dict(block=(16, 32), scale_fmt="ue8m0", expert_dtype="fp8"),
}


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("dense"), NAME)


@pytest.fixture(scope="module", params=sorted(FORMATS))
def quant_dir(request, dense_dir, tmp_path_factory):
    return quantize_checkpoint(dense_dir, tmp_path_factory.mktemp(request.param), **FORMATS[request.param])


def engine(path, **kw) -> Engine:
    kw.setdefault("kv_cache_bytes", 8 << 20)
    return Engine(EngineConfig(model=str(path), block_tokens=BT, dtype="float32", **kw))



def test_released_format_loads_quantized_with_mtp_layers(quant_dir):
    _, model = load_model(quant_dir, dtype="bfloat16")
    attn, ffn = model.layers[1].attn, model.layers[1].ffn
    assert isinstance(attn.wq_a, FP8Linear) and attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert isinstance(attn.indexer.wq_b, FP8Linear) and isinstance(ffn.shared_experts.w1, FP8Linear)
    assert isinstance(ffn.experts, QuantExperts)
    assert ffn.experts.w1.dtype in (torch.int8, torch.float8_e4m3fn)
    for bf16 in (attn.compressor.wkv, attn.indexer.compressor.wgate, attn.indexer.weights_proj, model.head):
        assert type(bf16) is torch.nn.Linear and bf16.weight.dtype == torch.bfloat16
    assert len(model.mtp) == 1 and isinstance(model.mtp[0].e_proj, FP8Linear)
    assert isinstance(model.mtp[0].ffn.experts, QuantExperts)


@pytest.mark.parametrize("prompt_len", [1, 37, 203])
def test_quantized_greedy_tokens_equal_transformers_on_the_same_files(quant_dir, prompt_len):
    prompt = random_prompt(prompt_len, seed=prompt_len)
    ref_tokens, ref_logprobs = reference_greedy(quant_dir, prompt, GREEDY.max_tokens)
    assert_same_run(engine(quant_dir).generate([prompt], GREEDY)[0], ref_tokens, ref_logprobs)


def test_quantized_batched_equals_one_at_a_time_and_chunked_equals_whole(quant_dir):
    prompts = [random_prompt(n, seed=n) for n in (1, 17, 64, 129)]
    e = engine(quant_dir)
    single = [e.generate([p], GREEDY)[0] for p in prompts]
    batched = e.generate(prompts, GREEDY)
    chunked = engine(quant_dir, max_batched_tokens=7).generate(prompts, GREEDY)
    for s, b, c in zip(single, batched, chunked):
        assert s.token_ids == b.token_ids == c.token_ids
        assert max(abs(x - y) for x, y in zip(s.logprobs + b.logprobs, b.logprobs + c.logprobs)) < TOL


@pytest.mark.parametrize("policy", ["full", "periodic:32", "zero"])
def test_quantized_restore_from_the_store_equals_the_cold_run(dense_dir, tmp_path, policy):
    qdir = quantize_checkpoint(dense_dir, tmp_path / "q", **FORMATS["ue8m0_fp4"])
    base = random_prompt(200, seed=5)
    prompt = base[:160] + random_prompt(9, seed=6)
    cold = engine(qdir, swa_policy=policy).generate([prompt], GREEDY)[0]
    writer = engine(qdir, swa_policy=policy, store=str(tmp_path / "store"))
    writer.generate([base], GREEDY)
    writer.flush()
    out = engine(qdir, swa_policy=policy, store=str(tmp_path / "store")).generate([prompt], GREEDY)[0]
    assert out.cached_tokens > 0
    assert_same_run(out, cold.token_ids, cold.logprobs)


def test_quantized_handoff_over_nixl_equals_a_single_engine_run(dense_dir, tmp_path):
    pytest.importorskip("nixl._api")
    from kvmesh.kvstore.transfer.nixl_transfer import KVTransferAgent
    qdir = quantize_checkpoint(dense_dir, tmp_path / "q", **FORMATS["ue8m0_fp4"])
    prompt = random_prompt(75, seed=3)
    single = engine(qdir).generate([prompt], GREEDY)[0]
    prefill, decode = engine(qdir), engine(qdir)
    src = KVTransferAgent("q-prefill", prefill.cache.all_tensors())
    dst = KVTransferAgent("q-decode", decode.cache.all_tensors())
    try:
        prefill.add_request("r", prompt, GREEDY, hold_kv=True)
        first = [o for o in _run(prefill)][-1]
        held = prefill.held_handle("r")
        remote = src.describe(prefill.cache.block_regions(held.block_ids, held.slot))
        resume = Resume(first.first,
                        lambda cache, blocks, slot, reused: dst.read(remote, cache.block_regions(blocks, slot)),
                        first.cached_tokens, held.rng_state)
        decode.add_request("r", prompt, GREEDY, resume=resume)
        moved = [o for o in _run(decode) if o.finished][-1]
        prefill.release_held("r")
    finally:
        src.close()
        dst.close()
    assert_same_run(moved, single.token_ids, single.logprobs)


def _run(e: Engine):
    outs = []
    while e.has_unfinished():
        outs += e.step()
    return outs


# --- malformed checkpoints fail at load, naming the tensor -------------------------------------

def _rewrite(qdir, tmp_path, edit_tensors=None, edit_config=None):
    out = tmp_path / "bad"
    out.mkdir()
    tensors = load_file(str(qdir / "model.safetensors"))
    cfg = json.loads((qdir / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(cfg)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def flash_dir(dense_dir, tmp_path_factory):
    return quantize_checkpoint(dense_dir, tmp_path_factory.mktemp("flash"), **FORMATS["ue8m0_fp4"])


def test_missing_scale_fails_naming_the_tensor(flash_dir, tmp_path):
    bad = _rewrite(flash_dir, tmp_path, lambda t: t.pop("layers.1.attn.wq_b.scale"))
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wq_b.*without its scale"):
        load_model(bad)


def test_wrong_scale_shape_fails_naming_the_tensor(flash_dir, tmp_path):
    def edit(t):
        t["layers.2.attn.wo_b.scale"] = torch.ones(3, 3).to(torch.float8_e8m0fnu)
    with pytest.raises(CheckpointError, match=r"layers\.2\.attn\.wo_b\.scale: shape \(3, 3\), expected \(1, 1\)"):
        load_model(_rewrite(flash_dir, tmp_path, edit))


def test_wrong_fp4_expert_shape_fails_naming_the_tensor(flash_dir, tmp_path):
    def edit(t):
        for e in range(4):
            t[f"layers.1.ffn.experts.{e}.w2.weight"] = t[f"layers.1.ffn.experts.{e}.w2.weight"][:, :8].contiguous()
    with pytest.raises(CheckpointError, match=r"layers\.1\.ffn\.experts\.\*\.w2\.weight: shape"):
        load_model(_rewrite(flash_dir, tmp_path, edit))


def test_one_experts_bad_scale_is_named_as_the_checkpoint_stores_it(flash_dir, tmp_path):
    """One expert's scale, stored V3-style as `weight_scale_inv` under the `model.` prefix that
    save_pretrained adds: the error names exactly that tensor, not the stacked in-memory name."""
    def edit(t):
        for k in list(t):
            t["model." + k.replace(".scale", ".weight_scale_inv")] = t.pop(k)
        t["model.layers.1.ffn.experts.2.w2.weight_scale_inv"] = torch.ones(3, 3).to(torch.float8_e8m0fnu)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.ffn\.experts\.2\.w2\.weight_scale_inv has shape "
                                              r"\(3, 3\): the layer's other experts have"):
        load_model(_rewrite(flash_dir, tmp_path, edit))


def test_a_missing_expert_is_named_as_the_checkpoint_would_store_it(flash_dir, tmp_path):
    def edit(t):
        t.pop("layers.1.ffn.experts.1.w3.weight")
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: layers\.1\.ffn\.experts\.1\.w3\.weight$"):
        load_model(_rewrite(flash_dir, tmp_path, edit))


def test_a_stacked_experts_format_error_names_the_stored_tensors(flash_dir, tmp_path):
    def edit(t):
        for e in range(4):
            t[f"model.layers.2.ffn.experts.{e}.w1.weight_scale_inv"] = t.pop(f"layers.2.ffn.experts.{e}.w1.scale")[:, :1].contiguous()
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.ffn\.experts\.\*\.w1\.weight_scale_inv: shape"):
        load_model(_rewrite(flash_dir, tmp_path, edit))


def test_unknown_expert_dtype_fails_naming_the_key(flash_dir, tmp_path):
    bad = _rewrite(flash_dir, tmp_path, edit_config=lambda c: c.update(expert_dtype="int4"))
    with pytest.raises(CheckpointError, match=r"expert_dtype 'int4'"):
        load_model(bad)


def test_experts_stored_unlike_expert_dtype_fail(flash_dir, tmp_path):
    bad = _rewrite(flash_dir, tmp_path, edit_config=lambda c: c.update(expert_dtype="fp8"))
    with pytest.raises(CheckpointError, match=r"experts\.\*\.w1\.weight: dtype torch\.int8, expected float8_e4m3fn"):
        load_model(bad)


def test_quantized_tensors_without_quantization_config_fail(flash_dir, tmp_path):
    bad = _rewrite(flash_dir, tmp_path, edit_config=lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match=r"quantized but config\.json has no quantization_config"):
        load_model(bad)


def test_kvmesh_inspect_reports_dtypes_mtp_resident_bytes_and_kv_per_token(flash_dir, capsys):
    from kvmesh.cluster.cli import main
    assert main(["inspect", "--model", str(flash_dir), "--block-tokens", str(BT)]) == 0
    out = capsys.readouterr().out
    for dtype in ("F8_E4M3", "F8_E8M0", "I8", "BF16", "F32"):
        assert f"\n{dtype} " in out
    assert "MTP layers: 1" in out and "expert_dtype fp4" in out
    ratio = float(out.split("x the file's tensor bytes")[0].rsplit(", ", 1)[1])
    assert 0.95 < ratio < 1.05
    assert "kv_cache_dtype bfloat16, block_tokens 16): 28.0 B/token classical" in out
    assert "kv_cache_dtype fp8, block_tokens 16): 20.0 B/token classical" in out


def test_sharded_release_with_scales_in_another_shard_loads_the_same(flash_dir, tmp_path):
    tensors = load_file(str(flash_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": [n for n in names if not n.endswith(".scale")],
              "model-00002-of-00002.safetensors": [n for n in names if n.endswith(".scale")]}
    out = tmp_path / "sharded"
    out.mkdir()
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(out / shard))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    (out / "config.json").write_text((flash_dir / "config.json").read_text())
    prompt = random_prompt(40, seed=4)
    a, b = engine(flash_dir).generate([prompt], GREEDY)[0], engine(out).generate([prompt], GREEDY)[0]
    # the same weights; the logprobs agree to float rounding, not bit for bit (the two loads'
    # buffers differ in alignment, which CPU kernels may take different vector paths for)
    assert_same_run(a, b, tol=1e-5)


def test_quantized_weights_with_the_fp8_kv_cache_restore_equals_cold(flash_dir, tmp_path):
    base = random_prompt(200, seed=8)
    prompt = base[:176] + random_prompt(5, seed=9)
    cold = engine(flash_dir, kv_cache_dtype="fp8").generate([prompt], GREEDY)[0]
    writer = engine(flash_dir, kv_cache_dtype="fp8", store=str(tmp_path))
    writer.generate([base], GREEDY)
    writer.flush()
    out = engine(flash_dir, kv_cache_dtype="fp8", store=str(tmp_path)).generate([prompt], GREEDY)[0]
    assert out.cached_tokens > 0
    assert_same_run(out, cold.token_ids, cold.logprobs)
