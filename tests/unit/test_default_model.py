"""The built-in default model: byte-for-byte reproducible, every V4 part present, and a real
DeepSeek-V4 checkpoint as far as transformers is concerned (same greedy tokens)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import random_prompt, reference_greedy
from workers.config import CSA, HCA, SWA, ModelArgs
from workers.default_model import DEFAULT_CONFIG, ensure_default_model, write_checkpoint
from workers.engine import Engine, EngineConfig
from workers.sampling import SamplingParams

FILES = ("config.json", "model.safetensors")


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("default"), DEFAULT_CONFIG)


def test_default_model_is_byte_for_byte_deterministic(default_dir, tmp_path):
    again = write_checkpoint(tmp_path / "again", DEFAULT_CONFIG)
    via_ensure = ensure_default_model(tmp_path / "ensured")
    for name in FILES:
        data = (default_dir / name).read_bytes()
        assert data == (again / name).read_bytes() == (via_ensure / name).read_bytes(), name


def test_default_model_has_every_layer_type_and_both_moe_kinds(default_dir):
    args = ModelArgs.from_file(default_dir / "config.json")
    assert set(args.layer_types) == {SWA, CSA, HCA}
    assert set(args.mlp_layer_types) == {"hash_moe", "moe"}
    assert args.compress_rope.rope_type == "yarn"


def test_default_model_loads_in_transformers_and_engine_greedy_equals_reference(default_dir):
    from transformers import DeepseekV4ForCausalLM
    _, info = DeepseekV4ForCausalLM.from_pretrained(default_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    prompt = random_prompt(21, vocab=DEFAULT_CONFIG["vocab_size"], seed=5)
    ref_tokens, ref_logprobs = reference_greedy(default_dir, prompt, 4)
    engine = Engine(EngineConfig(model=str(default_dir), kv_cache_bytes=32 << 20))
    out = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == ref_tokens
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref_logprobs)) < 2e-4
