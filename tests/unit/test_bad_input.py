"""Bad checkpoints and bad prompts fail with specific errors that say what is wrong, and
legacy config keys mean exactly what the modern keys (and transformers) say they mean."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.helpers import random_prompt, tiny_engine, write_tiny_checkpoint
from kvmesh.workers.checkpoint.loader import CheckpointError
from kvmesh.workers.engine import Engine
from kvmesh.workers.model.args import CSA, HCA, SWA, ModelArgs
from kvmesh.workers.sampling.params import InvalidRequestError, PromptTooLongError, SamplingParams

NAME, BLOCK = "swa_csa_hca", 16
WQ_A = "model.layers.1.attn.wq_a.weight"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp(NAME), NAME)


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return tiny_engine(checkpoint, NAME, max_model_len=64)


def load(path: Path) -> Engine:
    return tiny_engine(path, NAME)


def broken_copy(checkpoint: Path, tmp_path: Path, config=None, tensors=None, weights_bytes=None) -> Path:
    """A copy of the checkpoint with its config, tensors or weight bytes replaced."""
    path = tmp_path / "broken"
    shutil.copytree(checkpoint, path)
    if config is not None:
        (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if tensors is not None:
        save_file(tensors(load_file(path / "model.safetensors")), path / "model.safetensors")
    if weights_bytes is not None:
        (path / "model.safetensors").write_bytes(weights_bytes)
    return path


def config_of(checkpoint: Path, **changes) -> dict:
    return {**json.loads((checkpoint / "config.json").read_text()), **changes}


# ---- checkpoints ------------------------------------------------------------------------------
def test_missing_model_dir(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load(tmp_path / "nowhere")


def test_missing_config_json(checkpoint, tmp_path):
    path = broken_copy(checkpoint, tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json not found"):
        load(path)


def test_config_json_that_is_not_json(checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load(broken_copy(checkpoint, tmp_path, config="{ model_type: deepseek_v4"))


def test_unsupported_model_type(checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match=r"unsupported model_type 'llama'"):
        load(broken_copy(checkpoint, tmp_path, config=config_of(checkpoint, model_type="llama")))


def test_missing_tensor_is_named(checkpoint, tmp_path):
    def drop(t):
        del t[WQ_A]
        return t
    with pytest.raises(CheckpointError, match=r"missing \['layers.1.attn.wq_a.weight'\]"):
        load(broken_copy(checkpoint, tmp_path, tensors=drop))


def test_tensor_with_wrong_shape_is_named(checkpoint, tmp_path):
    def shrink(t):
        t[WQ_A] = t[WQ_A][:-1].contiguous()
        return t
    with pytest.raises(CheckpointError, match=r"layers.1.attn.wq_a.weight has shape \(31, 64\).*\(32, 64\)"):
        load(broken_copy(checkpoint, tmp_path, tensors=shrink))


def test_unknown_quantization_method_is_refused(checkpoint, tmp_path):
    q = {"quant_method": "awq", "bits": 4}
    with pytest.raises(CheckpointError, match="quant_method 'awq' is not supported"):
        load(broken_copy(checkpoint, tmp_path, config=config_of(checkpoint, quantization_config=q)))


def test_corrupt_safetensors_file(checkpoint, tmp_path):
    data = (checkpoint / "model.safetensors").read_bytes()
    for name, corrupt in {"garbage": b"\x00\x01not a safetensors file", "truncated": data[: len(data) // 2]}.items():
        with pytest.raises(CheckpointError, match="model.safetensors: unreadable safetensors file"):
            load(broken_copy(checkpoint, tmp_path / name, weights_bytes=corrupt))


def test_no_weights_at_all(checkpoint, tmp_path):
    path = broken_copy(checkpoint, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*.safetensors weights"):
        load(path)


# ---- prompts ----------------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_prompt_longer_than_the_limit(engine):
    with pytest.raises(PromptTooLongError, match="exceeds the model's limit of 64 tokens"):
        engine.add_request("long", random_prompt(60), GREEDY)
    engine.add_request("fits", random_prompt(56), GREEDY)   # 56 + 8 = 64 is allowed
    engine.abort("fits")
    assert not engine.has_unfinished()


@pytest.mark.parametrize("prompt,why", [
    ([5, 300], "outside the vocabulary"),
    ([-1, 5], "outside the vocabulary"),
    ([], "must not be empty"),
    ("", "must not be empty"),
    ([1.5, 2], "integer token ids"),
    (["a", "b"], "integer token ids"),
    ([True, 4], "integer token ids"),
    (None, "integer token ids"),
])
def test_invalid_prompts_are_refused(engine, prompt, why):
    with pytest.raises(InvalidRequestError, match=f"prompt: .*{why}"):
        engine.add_request("bad", prompt, GREEDY)
    assert not engine.has_unfinished()


# ---- legacy config keys -------------------------------------------------------------------------
COMMON = dict(model_type="deepseek_v4", vocab_size=1000, hidden_size=256, num_hidden_layers=6,
              num_attention_heads=8, head_dim=128, q_lora_rank=64, moe_intermediate_size=64,
              n_routed_experts=8, num_experts_per_tok=2, o_groups=2, o_lora_rank=32,
              rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=65536)
YARN = {"factor": 16, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
MODERN = {**COMMON,
          "layer_types": [SWA, CSA, HCA, CSA, HCA, SWA],
          "compress_rates": {CSA: 8, HCA: 64},
          "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
          "partial_rotary_factor": 32 / 128,
          "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                              "compress": {"rope_type": "yarn", "rope_theta": 160000.0, **YARN}}}
LEGACY = {**COMMON,
          "compress_ratios": [0, 4, 128, 4, 128, 0],
          "compress_rate_csa": 8, "compress_rate_hca": 64,
          "num_hash_layers": 2,
          "qk_rope_head_dim": 32,
          "rope_scaling": {"type": "yarn", **YARN}}


def test_legacy_keys_parse_to_the_same_model_args_as_modern_keys():
    modern, legacy = ModelArgs.from_dict(MODERN), ModelArgs.from_dict(LEGACY)
    assert legacy == modern
    assert modern.layer_types == (SWA, CSA, HCA, CSA, HCA, SWA)
    assert modern.compress_ratios == (0, 8, 64, 8, 64, 0)
    assert modern.mlp_layer_types == ("hash_moe",) * 2 + ("moe",) * 4
    assert modern.rope_head_dim == 32
    assert modern.main_rope.rope_type == "default" and modern.main_rope.theta == 10000.0
    assert (modern.compress_rope.rope_type, modern.compress_rope.theta, modern.compress_rope.factor,
            modern.compress_rope.original_max_position_embeddings) == ("yarn", 160000.0, 16.0, 4096)


@pytest.mark.parametrize("keys", ["modern", "legacy", "legacy_flat_rope_parameters"])
def test_transformers_parses_the_same_config_the_same_way(keys):
    from transformers import DeepseekV4Config
    raw = {"modern": MODERN, "legacy": LEGACY,
           # a flat rope dict that carries its own rope_theta: the compress rope still uses
           # compress_rope_theta (transformers' rule)
           "legacy_flat_rope_parameters": {**{k: v for k, v in LEGACY.items() if k != "rope_scaling"},
                                           "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, **YARN}},
           }[keys]
    ours = ModelArgs.from_dict(raw)
    theirs = DeepseekV4Config(**{k: v for k, v in raw.items() if k != "model_type"})
    assert ours == ModelArgs.from_dict(MODERN)
    assert ours.layer_types == tuple(theirs.layer_types)
    assert ours.mlp_layer_types == tuple(theirs.mlp_layer_types)
    assert {CSA: ours.csa_ratio, HCA: ours.hca_ratio} == theirs.compress_rates
    assert ours.rope_head_dim == theirs.qk_rope_head_dim == int(theirs.head_dim * theirs.partial_rotary_factor)
    main, compress = theirs.rope_parameters["main"], theirs.rope_parameters["compress"]
    assert (ours.main_rope.rope_type, ours.main_rope.theta) == (main["rope_type"], main["rope_theta"])
    assert (ours.compress_rope.rope_type, ours.compress_rope.theta, ours.compress_rope.factor,
            ours.compress_rope.original_max_position_embeddings) == (
        compress["rope_type"], compress["rope_theta"], compress["factor"], compress["original_max_position_embeddings"])


def test_v4_pro_default_layer_schedule_matches_transformers():
    from transformers import DeepseekV4Config
    raw = {k: v for k, v in COMMON.items()}
    raw["num_hidden_layers"] = 61
    ours, theirs = ModelArgs.from_dict(raw), DeepseekV4Config(**{k: v for k, v in raw.items() if k != "model_type"})
    assert ours.layer_types == tuple(theirs.layer_types)
    assert ours.mlp_layer_types == tuple(theirs.mlp_layer_types)
    assert ours.compress_ratios[:4] == (128, 128, 128, 4)
