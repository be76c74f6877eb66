"""The built-in default model: shipped inside the package, every V4 part present, a real
DeepSeek-V4 checkpoint as far as transformers is concerned (same greedy tokens), a BPE
tokenizer whose vocabulary is the model's with V4's chat tokens, greedy continuations that
read as English, and chat replies in V4's format (reasoning, </think>, content, EOS)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvmesh.cluster.chat.dsv4_encode import CHAT, END_THINK, THINKING, encode_messages
from kvmesh.cluster.chat.dsv4_parse import ReplyParser
from scripts.default_chat_data import V4_TOKENS
from tests.helpers import random_prompt, reference_greedy
from kvmesh.workers.checkpoint.default_model import DEFAULT_MODEL_FILES, default_model_dir, ensure_default_model
from kvmesh.workers.checkpoint.loader import CheckpointError
from kvmesh.workers.checkpoint.tokenizer import HFTokenizer, load_tokenizer
from kvmesh.workers.engine import Engine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.model.args import CSA, HCA, SWA, ModelArgs
from kvmesh.workers.sampling.params import SamplingParams

PROMPT = "The king said to his servants,"


@pytest.fixture(scope="module")
def default_dir() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="module")
def engine(default_dir) -> Engine:
    return Engine(EngineConfig(kv_cache_bytes=32 << 20))   # no model given: the built-in one


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    return engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].token_ids


def test_default_model_ships_inside_the_package(default_dir):
    import kvmesh.workers.checkpoint
    assert default_dir == Path(kvmesh.workers.checkpoint.__file__).parent / "default_checkpoint" == default_model_dir()
    assert all((default_dir / name).is_file() for name in DEFAULT_MODEL_FILES)
    assert (default_dir / "model.safetensors").stat().st_size < 16 << 20


def test_default_model_missing_files_is_a_clear_error(default_dir, tmp_path):
    for name in DEFAULT_MODEL_FILES[:-1]:
        shutil.copy(default_dir / name, tmp_path / name)
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        ensure_default_model(tmp_path)


def test_default_model_has_every_layer_type_and_both_moe_kinds(default_dir):
    args = ModelArgs.from_file(default_dir / "config.json")
    assert set(args.layer_types) == {SWA, CSA, HCA}
    assert set(args.mlp_layer_types) == {"hash_moe", "moe"}
    assert args.hc_mult > 1
    assert args.compress_rope.rope_type == "yarn"


def test_default_tokenizer_vocabulary_equals_config_and_embedding_rows(default_dir):
    tok = load_tokenizer(default_dir)
    assert isinstance(tok, HFTokenizer)
    vocab = json.loads((default_dir / "config.json").read_text())["vocab_size"]
    with safe_open(str(default_dir / "model.safetensors"), "pt") as f:
        embed_rows = f.get_slice("model.embed_tokens.weight").get_shape()[0]
        head_rows = f.get_slice("head.weight").get_shape()[0]
    assert tok.vocab_size == vocab == embed_rows == head_rows


def test_default_tokenizer_has_v4s_chat_tokens_so_chat_uses_v4s_format(default_dir):
    """One id each, after the 2,048 trained ones, not special (as DeepSeek's tokenizers mark
    them): the checkpoint is served in V4's chat format (cluster/chat/dsv4_encode.py)."""
    tok = load_tokenizer(default_dir)
    assert [tok.encode_rendered(t) for t in V4_TOKENS] == [[2048 + i] for i in range(len(V4_TOKENS))]
    added = {t.content: t.special for t in tok._tok.get_added_tokens_decoder().values()}
    assert not any(added[t] for t in V4_TOKENS)
    assert tok.chat_format == "dsv4" and tok.chat_template is None


@pytest.mark.parametrize("text", [PROMPT, "Hello, world!\n\tTabs, newlines  and   spaces.",
                                  "Numbers 3.14 and 42; symbols <>{}[]#@~", "naïve café, Grüße, 東京, emoji 🙂"])
def test_default_tokenizer_round_trips_text(default_dir, text):
    tok = load_tokenizer(default_dir)
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_default_tokenizer_is_bpe_not_bytes(default_dir):
    """Merges learned from English: common words are one token each."""
    tok = load_tokenizer(default_dir)
    assert len(tok.encode(" the")) == len(tok.encode(" and")) == 1
    assert len(tok.encode(PROMPT)) < len(PROMPT) / 2.5


def test_default_model_greedy_continuation_reads_as_english(engine, default_dir):
    tok = load_tokenizer(default_dir)
    text = tok.decode(greedy(engine, tok.encode(PROMPT), 32))
    assert text and text.isascii(), text
    assert sum(c.isalpha() or c.isspace() for c in text) >= 0.85 * len(text), text
    words = re.findall(r"[A-Za-z']+", text)
    assert len(words) >= 10 and len({w.lower() for w in words}) >= 5, text
    # every word is a whole token of the learned vocabulary (byte soup makes fragments)
    vocab = tok._tok.get_vocab()
    whole = [w for w in words if f"Ġ{w}" in vocab or w in vocab]
    assert len(whole) >= 0.9 * len(words), (text, set(words) - set(whole))


CHAT_ASK = [{"role": "user", "content": "Continue: In the beginning"}]


@pytest.mark.parametrize("mode", [THINKING, CHAT])
def test_default_model_replies_in_v4s_chat_format(engine, default_dir, mode):
    """Greedy, the built-in model writes a thinking-mode reply as reasoning, `</think>`, content,
    EOS and a chat-mode reply as content, EOS: both parts English, nothing cut by max_tokens."""
    tok = load_tokenizer(default_dir)
    prompt = tok.encode_rendered(encode_messages(CHAT_ASK, mode))
    out = engine.generate([prompt], SamplingParams(max_tokens=96, temperature=0.0))[0]
    assert out.token_ids[-1] == tok.eos_id and out.finish_reason == "stop"
    text = tok.decode_markup(out.token_ids)
    assert text.count(END_THINK) == (mode == THINKING)
    parser = ReplyParser(mode, tools=False)
    reply = parser.feed(text), parser.finish()
    reasoning, content = (reply[0].reasoning + reply[1].reasoning), (reply[0].content + reply[1].content)
    assert bool(reasoning) == (mode == THINKING) and content
    for part in filter(None, (reasoning, content)):
        assert part.isascii() and sum(c.isalpha() or c.isspace() for c in part) >= 0.8 * len(part), part


def test_default_model_loads_in_transformers_and_engine_greedy_equals_reference(default_dir, engine):
    from transformers import DeepseekV4ForCausalLM
    _, info = DeepseekV4ForCausalLM.from_pretrained(default_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    vocab = ModelArgs.from_file(default_dir / "config.json").vocab_size
    english = load_tokenizer(default_dir).encode("And God said, Let there be light: and there was light.")
    for prompt in (random_prompt(21, vocab=vocab, seed=5), english):
        ref_tokens, ref_logprobs = reference_greedy(default_dir, prompt, 6)
        out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
        assert out.token_ids == ref_tokens
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref_logprobs)) < 2e-4


# Measured at k = 1 on the built-in model's own text (32 openings x 64 greedy tokens: 0.740,
# docs/benchmarks.md); the test's 8 openings x 48 tokens must stay within MTP_MARGIN of it.
MTP_ACCEPTANCE, MTP_MARGIN = 0.90, 0.05     # measured (8 openings x 48 tokens); 0.74 before self-distillation
OPENINGS = ["The king said to his servants,", "In the beginning", "And the LORD spoke to Moses, saying,",
            "Then Jesus said to them,", "Blessed is the man who", "Now it happened in those days that",
            "Hear, O Israel:", "The word of the LORD came to me, saying,"]


def test_shipped_mtp_layer_drafts_are_accepted_and_leave_greedy_output_unchanged(default_dir):
    """The shipped checkpoint carries a trained MTP layer (mtp.safetensors, beside the main
    weights): its k = 1 drafts are accepted at about the measured rate on the model's own text,
    and greedy output with drafts (k = 1 and 3) is exactly the plain output."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    def run(k: int):
        e = Engine(EngineConfig(kv_cache_bytes=32 << 20, speculative_tokens=k))
        return [o.token_ids for o in e.generate(OPENINGS, params)], e.counters
    plain, _ = run(0)
    for k in (1, 3):
        tokens, c = run(k)
        assert tokens == plain
        if k == 1:
            assert c.draft_tokens > 8 * 48 // 2
            assert c.accepted_draft_tokens / c.draft_tokens >= MTP_ACCEPTANCE - MTP_MARGIN
