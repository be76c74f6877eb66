"""Invariant 1 and 2: the engine equals transformers' DeepseekV4ForCausalLM, and batching,
chunking and memory pressure never change the output."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    BLOCK_TOKENS,
    TINY_CONFIGS,
    random_prompt,
    reference_greedy,
    tiny_engine,
    write_tiny_checkpoint,
)
from kvmesh.workers.sampling.params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LOGPROB_TOL = 2e-4


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def checkpoint(request, tmp_path_factory):
    name = request.param
    return name, write_tiny_checkpoint(tmp_path_factory.mktemp(name), name)



@pytest.mark.parametrize("prompt_len", [1, 2, 37, 203])
def test_engine_greedy_tokens_and_logprobs_equal_transformers(checkpoint, prompt_len):
    name, path = checkpoint
    prompt = random_prompt(prompt_len, seed=prompt_len)
    ref_tokens, ref_logprobs = reference_greedy(path, prompt, GREEDY.max_tokens)
    out = tiny_engine(path, name).generate([prompt], GREEDY)[0]
    assert out.token_ids == ref_tokens
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref_logprobs)) < LOGPROB_TOL


@pytest.mark.slow
def test_engine_equals_transformers_on_a_prompt_over_1000_tokens(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "swa_csa_hca")
    prompt = random_prompt(1100, seed=11)
    ref_tokens, ref_logprobs = reference_greedy(path, prompt, 4)
    out = tiny_engine(path, "swa_csa_hca", max_batched_tokens=256).generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == ref_tokens
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref_logprobs)) < LOGPROB_TOL


def _prompts() -> list[list[int]]:
    return [random_prompt(n, seed=n) for n in (1, 5, 17, 64, 129, 90)]


def test_batched_equals_one_at_a_time_and_chunked_equals_whole(checkpoint):
    name, path = checkpoint
    engine = tiny_engine(path, name)
    single = [engine.generate([p], GREEDY)[0] for p in _prompts()]
    batched = engine.generate(_prompts(), GREEDY)
    chunked = tiny_engine(path, name, max_batched_tokens=7).generate(_prompts(), GREEDY)
    for s, b, c in zip(single, batched, chunked):
        assert s.token_ids == b.token_ids == c.token_ids
        assert max(abs(x - y) for x, y in zip(s.logprobs + b.logprobs, b.logprobs + c.logprobs)) < LOGPROB_TOL


def test_memory_budget_too_small_for_all_requests_still_completes_them_correctly(checkpoint):
    name, path = checkpoint
    roomy = tiny_engine(path, name).generate(_prompts(), GREEDY)
    roomy_engine = tiny_engine(path, name)
    layout = roomy_engine.layout
    needed = sum(-(-(len(p) + GREEDY.max_tokens) // BLOCK_TOKENS[name]) for p in _prompts())
    largest = max(-(-(len(p) + GREEDY.max_tokens) // BLOCK_TOKENS[name]) for p in _prompts())
    budget = 3 * layout.slot_bytes + largest * layout.resident_block_bytes(roomy_engine.cache.swa_blocks)
    tight_engine = tiny_engine(path, name, kv_cache_bytes=budget, max_num_seqs=3)
    assert tight_engine.blocks.num_blocks < needed
    tight = tight_engine.generate(_prompts(), GREEDY)
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]


def test_bf16_checkpoint_loads_and_generates(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "swa_csa_hca", dtype=torch.bfloat16)
    engine = tiny_engine(path, "swa_csa_hca")
    assert engine.model.head.weight.dtype == torch.bfloat16
    out = engine.generate([random_prompt(40)], GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_tokens and all(lp <= 0 for lp in out.logprobs)


def test_sharded_checkpoint_equals_single_file(tmp_path):
    single = write_tiny_checkpoint(tmp_path / "single", "swa_csa_hca")
    sharded = write_tiny_checkpoint(tmp_path / "sharded", "swa_csa_hca", max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").exists()
    prompt = random_prompt(50)
    a = tiny_engine(single, "swa_csa_hca").generate([prompt], GREEDY)[0]
    b = tiny_engine(sharded, "swa_csa_hca").generate([prompt], GREEDY)[0]
    assert a.token_ids == b.token_ids
