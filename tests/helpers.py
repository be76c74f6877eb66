"""Shared test helpers: tiny V4 checkpoints written by transformers itself, engines on
them, the transformers reference run every engine path is compared against, the
comparisons (`assert_same_run`, `assert_close`) and SSE parsing for the HTTP tests."""
from __future__ import annotations

import contextlib
import functools
import json
import subprocess
from pathlib import Path
from typing import Iterable, Iterator

import torch

# Three tiny configs chosen so that SWA windows, CSA/HCA windows and cache blocks cross
# each other: windows that are not multiples of the ratios, top-k smaller and larger than
# the number of compressed entries, every layer type, hash and top-k MoE layers.
TINY_BASE = dict(vocab_size=300, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4,
                 head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2,
                 o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, hc_mult=4,
                 max_position_embeddings=4096)
TINY_CONFIGS = {
    # SWA + CSA + HCA; window 8; top-k 4 < entries; blocks of 16 tokens
    "swa_csa_hca": dict(num_hidden_layers=3, sliding_window=8, index_topk=4,
                        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                        mlp_layer_types=["hash_moe", "moe", "moe"]),
    # window 6 (not a multiple of 4 or 8); HCA ratio 8; top-k 64 >= entries for short prompts
    "csa_hca_odd_window": dict(num_hidden_layers=4, sliding_window=6, index_topk=64,
                               layer_types=["compressed_sparse_attention", "heavily_compressed_attention",
                                            "compressed_sparse_attention", "sliding_attention"],
                               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                               mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"]),
    # HCA-heavy with a window larger than a block; yarn compress rope
    "hca_yarn_wide_window": dict(num_hidden_layers=3, sliding_window=24, index_topk=8,
                                 layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                              "heavily_compressed_attention"],
                                 compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                                 mlp_layer_types=["hash_moe", "moe", "moe"],
                                 rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 256}),
}
BLOCK_TOKENS = {"swa_csa_hca": 16, "csa_hca_odd_window": 8, "hca_yarn_wide_window": 32}


def write_tiny_checkpoint(path: Path, name: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                          overrides: dict | None = None, **save_kw) -> Path:
    """Random-init DeepseekV4ForCausalLM saved with save_pretrained (the real on-disk format);
    `overrides`: config keys changed from the tiny config `name`."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    cfg = DeepseekV4Config(**{**TINY_BASE, **TINY_CONFIGS[name], **(overrides or {})})
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg)
    with torch.no_grad():  # give sinks, biases and hash tables non-trivial values
        g = torch.Generator().manual_seed(seed + 1)
        for n, p in model.named_parameters():
            if n.endswith(("sinks", "position_bias", "e_score_correction_bias", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for n, b in model.named_buffers():
            if n.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                     for _ in range(cfg.vocab_size)]))
    model.to(dtype).save_pretrained(path, **save_kw)
    return path


def write_mtp_checkpoint(tmp_path_factory, name: str):
    """The tiny checkpoint `name` in the release's tensor names plus one (random) MTP layer,
    dense: its directory."""
    import json

    from safetensors.torch import load_file, save_file

    from tests.quant_checkpoint import _mtp_tensors, _upstream_name
    dense = write_tiny_checkpoint(tmp_path_factory.mktemp("dense"), name)
    state = {_upstream_name(k): v for k, v in load_file(str(dense / "model.safetensors")).items()}
    cfg = json.loads((dense / "config.json").read_text())
    state.update(_mtp_tensors(state, cfg, 1, seed=0))
    out = tmp_path_factory.mktemp("mtp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=1)))
    return out


def tiny_engine(path: Path, name: str, **kw):
    """An engine on the tiny checkpoint `name` at `path`: its block size, an 8 MiB KV budget
    (per rank at data_parallel_size > 1: a DataParallelEngine), one schema compiler process
    (each imports xgrammar and torch: ~3 s of a core; the tests of the pool's size set theirs)."""
    from kvmesh.workers.engine import open_engine
    from kvmesh.workers.engine_config import EngineConfig
    kw.setdefault("kv_cache_bytes", 8 << 20)
    kw.setdefault("grammar_compile_workers", 1)
    return open_engine(EngineConfig(model=str(path), block_tokens=BLOCK_TOKENS[name], **kw))


@functools.lru_cache(maxsize=8)
def reference_model(path: str):
    from transformers import DeepseekV4ForCausalLM
    return DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy generate (fp32, EOS ignored): tokens and chosen-token logprobs."""
    model = reference_model(str(path))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


def random_prompt(n: int, vocab: int = 300, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def random_cache(layout, num_blocks: int, num_slots: int, seed: int):
    """CacheTensors filled with seeded noise: distinct bytes everywhere a transfer could move."""
    from kvmesh.kvstore.device.cache_tensors import CacheTensors
    cache = CacheTensors(layout, num_blocks=num_blocks, num_slots=num_slots, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    for t in cache.all_tensors():
        t.copy_(torch.randn(t.shape, generator=g))
    return cache


def mtp_logits(path, tokens: list[int], block_tokens: int = 16, rows: list[int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(main streams [S, N, C], MTP logits [S - 1, V]: row t from the streams at t and token
    t + 1) from kvmesh: the main forward over the prompt as one prefill (keep_streams), then
    `MTPLayer.predict` and `Transformer.logits` through the layer's own head, as the drafter
    runs them; with `rows`, the layer runs past its K=V for those rows only (the logits are
    theirs) and the layer's window ring comes back too: (ring, logits)."""
    from kvmesh.kvstore.device.cache_tensors import CacheTensors, LayerCache
    from kvmesh.kvstore.device.layout import CacheLayout, LayoutParams, SWASpec
    from kvmesh.workers.checkpoint.loader import load_model
    from kvmesh.workers.model.step import StepInput
    args, model = load_model(path)
    layout = CacheLayout.build(LayoutParams(args.layer_types, args.head_dim, args.index_head_dim, args.csa_ratio,
                                            args.hca_ratio, args.sliding_window, "float32", "auto",
                                            args.rope_head_dim), block_tokens)
    blocks = -(-len(tokens) // block_tokens)
    cache = CacheTensors(layout, num_blocks=blocks, num_slots=1)

    def step(ids: list[int], blocks: int) -> StepInput:
        t = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
        s = len(ids)
        return StepInput(tokens=t(ids), positions=torch.arange(s), q_seq=torch.zeros(s, dtype=torch.long),
                         starts=t([0]), lengths=t([s]), slots=t([0]),
                         block_table=torch.arange(blocks, dtype=torch.int32).unsqueeze(0), ring_from=t([0]),
                         keep_tokens=t([0]), logits_at=torch.arange(s))
    _, streams = model(step(tokens, blocks), cache, keep_streams=True)
    ring = LayerCache(SWASpec(block_tokens=0, head_dim=args.head_dim, window=args.sliding_window, dtype="float32"),
                      num_blocks=0, num_slots=1)
    layer, mstep = model.mtp[0], step(tokens[1:], 1)
    with torch.inference_mode():
        x = layer.predict(streams[:-1], mstep.tokens, model.embed, mstep, ring, model.ropes, model.ops,
                          None if rows is None else torch.tensor(rows))
        return (streams if rows is None else ring.ring), model.logits(x, layer)


LOGPROB_TOL = 2e-4      # chosen-token logprobs of two fp32 runs that must agree


def assert_same_run(out, ref, ref_logprobs: list[float] | None = None, tol: float = LOGPROB_TOL) -> None:
    """`out` equals a reference run: the same tokens, chosen-token logprobs within `tol`.
    `ref` is an output with token_ids / logprobs, or the tokens with `ref_logprobs` beside."""
    tokens, logprobs = (ref.token_ids, ref.logprobs) if ref_logprobs is None else (ref, ref_logprobs)
    assert out.token_ids == tokens
    assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < tol


def cold_references(path: Path, name: str, prompts: dict[str, list[list[int]]], greedy, forks) -> dict:
    """A TP=1 engine's outputs without a store (what the parallel engines are compared with): each
    group of `prompts` with `greedy`, and "forks": the first of prompts["B"] with `forks`."""
    cold = tiny_engine(path, name)
    refs = {k: cold.generate(ps, greedy) for k, ps in prompts.items()}
    refs["forks"] = cold.generate(prompts["B"][:1], forks)
    cold.close()
    return refs


def stored_by_tp1(path: Path, name: str, store: str, swa_policy: str, prompts: list[list[int]], params) -> str:
    """`store` after a TP=1 engine ran `prompts` on it (what a parallel engine then restores)."""
    writer = tiny_engine(path, name, swa_policy=swa_policy, store=store)
    writer.generate(prompts, params)
    writer.close()
    return store


def run_to_end(engine) -> list:
    """Every output of `engine.step()` until nothing is left to run."""
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def assert_same_outputs(outs, refs, tol: float = 1e-4) -> None:
    """Two engines' outputs for the same requests: the same tokens, logprobs within `tol`."""
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert max(abs(x - y) for o, r in zip(outs, refs) for x, y in zip(o.logprobs, r.logprobs)) < tol


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: dict) -> None:
    """A kernel's output against its torch reference: same dtype and shape, values within
    tol[dtype] (atol / rtol), compared in float32."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), **tol[ref.dtype])


def sse_events(lines: Iterable[str]) -> Iterator:
    """The payloads of an SSE stream's `data:` lines as they arrive: JSON decoded, the final
    "[DONE]" kept as is."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def stream_items(lines: Iterable[str]) -> Iterator[tuple[list[int], dict | None]]:
    """A completion stream (return_token_ids) as it arrives: (token ids, None) per chunk,
    ([], the error) per error event."""
    for event in sse_events(lines):
        if event != "[DONE]":
            yield ([], event["error"]) if "error" in event else (event["choices"][0]["token_ids"], None)


def stream_and_kill(url: str, body: dict, kill, bound_s: float, after_tokens: int = 5):
    """Stream a completion from `url` and call `kill()` once `after_tokens` tokens arrived.
    Returns (tokens, errors, elapsed s); the stream must end within `bound_s`."""
    import time

    import httpx
    tokens, errors, killed = [], [], False
    start = time.monotonic()
    with httpx.Client(timeout=httpx.Timeout(bound_s)) as client:
        with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            for ids, error in stream_items(r.iter_lines()):
                if error is not None:
                    errors.append(error)
                    continue
                tokens += ids
                if len(tokens) >= after_tokens and not killed:
                    kill()
                    killed = True
    elapsed = time.monotonic() - start
    print(f"stream ended after {elapsed:.1f}s with {len(tokens)} tokens, errors={errors}")
    assert killed and elapsed < bound_s
    return tokens, errors, elapsed


def assert_clean_end(tokens: list[int], errors: list[dict], want: list[int]) -> None:
    """A stream whose worker died ends either in a clean OpenAI error after a greedy prefix
    or, retried, in exactly the greedy stream."""
    if errors:
        assert set(errors[0]) == {"message", "type", "param", "code"}
        assert tokens == want[:len(tokens)]
    else:
        assert tokens == want


V4_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜pad｜>", "<｜User｜>", "<｜Assistant｜>",
              "<｜latest_reminder｜>"]
V4_MARKUP = ["<think>", "</think>", "｜DSML｜"]       # added tokens; special or not, as a file may have them
V4_CORPUS = ["You are a helpful assistant.", "What's the weather in Beijing?", "The weather is sunny, 22°C.",
             '<｜DSML｜invoke name="get_weather">', '<｜DSML｜parameter name="location" string="true">Paris',
             "</｜DSML｜parameter>", "</｜DSML｜invoke>", "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>",
             '{"type": "object", "properties": {"city": {"type": "string"}}}', "<tool_result>", "</tool_result>"] * 4


def write_v4_tokenizer(path: Path, vocab_size: int = 300, markup_special: bool = False) -> Path:
    """A byte-level BPE tokenizer with DeepSeek-V4's special tokens (BOS 0, EOS 1, pad 2, the turn
    tokens) and `<think>`, `</think>`, `｜DSML｜` as added tokens, written beside a tiny checkpoint
    (at most `vocab_size` ids, so every id has a row in the model's embedding)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(V4_CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size - len(V4_MARKUP), special_tokens=V4_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(t, special=markup_special, normalized=False) for t in V4_MARKUP])
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": V4_SPECIAL[0], "eos_token": V4_SPECIAL[1],
         "pad_token": V4_SPECIAL[2]}))
    return path


@contextlib.contextmanager
def undeletable(path: Path):
    """`path` cannot be removed or replaced, even by root: the immutable attribute (skips where
    chattr is not supported)."""
    import pytest
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def assert_rank_failure_is_quick(path: Path, name: str, rank1_pid, hows: tuple[str, ...] = ("stall", "kill"),
                                 **parallel) -> None:
    """A replica (`parallel`: its sizes; rank_timeout_s 3 s) whose rank 1 (`rank1_pid(engine)`) is
    stopped, then one whose rank 1 is killed (`hows`), mid-request: RankFailed within the timeout
    (never a hang), the engine stays failed, and close() is quick."""
    import os
    import signal
    import time

    import pytest

    from kvmesh.workers.parallel.collectives import RankFailed
    from kvmesh.workers.sampling.params import SamplingParams
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for how, bound in [(h, b) for h, b in (("stall", 3.0 + 5), ("kill", 5.0)) if h in hows]:
        engine = tiny_engine(path, name, rank_timeout_s=3.0, **parallel)
        try:
            engine.add_request("r", random_prompt(40), long)
            engine.step()
            os.kill(rank1_pid(engine), signal.SIGSTOP if how == "stall" else signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(RankFailed):
                while engine.has_unfinished():
                    engine.step()
            assert time.monotonic() - t0 < bound, how
            with pytest.raises(RankFailed):           # the engine stays failed
                engine.step()
        finally:
            t0 = time.monotonic()
            engine.close()
            assert time.monotonic() - t0 < 15


# The two tools the built-in model was trained to call, and the question it answers with a call
# (the serve chat tests and bench/tool_call.py).
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                                              "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "set_flags", "parameters": {
        "type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
        "required": ["flags"]}}},
]
ASK = [{"role": "user", "content": "What's the weather in Beijing?"}]
