"""The incremental detokenizer (cluster/chat/detokenizer.py): text deltas concatenate to the
decoded text and hold back partial UTF-8, stop strings end the text before them (across
chunks, the earliest of several), and each token decodes a bounded window. For a tokenizer.json
`tokenizers`' DecodeStream does the windows: random token streams give the same deltas as the
Python windows through `decode`, for the default model's, the tests' V4 and two SentencePiece-style
tokenizers (no other tokenizer.json is on disk here)."""
from __future__ import annotations

import random

import pytest

from kvmesh.cluster.chat.detokenizer import REPLACEMENT, Detokenizer
from kvmesh.workers.checkpoint.tokenizer import ByteTokenizer

TOK = ByteTokenizer()



def stream(text_tokens: list[list[int]], stops: list[str]) -> tuple[str, Detokenizer]:
    d = Detokenizer(TOK.decode, stops)
    out = ""
    for ids in text_tokens:
        out += d.add(ids)
        if d.stopped:
            break
    return out + d.finish(), d


def test_deltas_concatenate_to_the_decoded_text_and_hold_back_partial_utf8():
    ids = TOK.encode("héllo €uro")
    d = Detokenizer(TOK.decode, [])
    deltas = [d.add([t]) for t in ids]
    assert "".join(deltas) + d.finish() == "héllo €uro"
    assert all("\ufffd" not in x for x in deltas)


def test_stop_string_spanning_chunks_ends_the_text_before_it():
    ids = TOK.encode("abc STOP def")
    text, d = stream([[t] for t in ids], ["STOP"])
    assert text == "abc " and d.stopped


def test_text_that_only_looks_like_a_stop_prefix_is_released():
    text, d = stream([TOK.encode("abc ST"), TOK.encode("ar")], ["STOP"])
    assert text == "abc STar" and not d.stopped


def test_earliest_of_several_stop_strings_wins():
    text, _ = stream([TOK.encode("one two three")], ["three", "two"])
    assert text == "one "


def test_the_detokenizer_decodes_a_bounded_window_per_token_and_still_matches_stops():
    tok, seen = ByteTokenizer(), []

    def decode(ids):
        seen.append(len(ids))
        return tok.decode(ids)
    ids = tok.encode("é" * 3000 + " the END here")
    d = Detokenizer(decode, ["END"])
    text = "".join(d.add([t]) for t in ids if not d.stopped) + d.finish()
    assert text == "é" * 3000 + " the " and d.stopped
    assert max(seen) <= 4          # each add decodes a few tokens, not the whole output


# --- DecodeStream (`tokenizers`) against the Python windows: the same deltas ---------------------

UNICODE_TEXT = ["héllo", " €uro", " 日本語", " 🙂👍🏽", " naïve café", " e\u0301", " the END", " stop\n\nhere", " 22°C",
                " <think>", "</think>", " plain words and more words", " Ω≈ç√", " ｜DSML｜"]
STOPS = ["END", "\n\n", "日本", "€u", "👍", "zz"]


def sentencepiece_tokenizer(path, decoder: str):
    """A SentencePiece-style tokenizer.json, `▁` for spaces, with a decoder that drops the first
    token's leading space: "strip" is Llama/Mistral's (BPE with byte fallback, `<0xNN>` tokens;
    Replace, ByteFallback, Fuse, Strip), "metaspace" the Metaspace decoder (no byte fallback)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from kvmesh.workers.checkpoint.tokenizer import load_tokenizer
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(UNICODE_TEXT * 3 + ["the quick brown fox jumps over the lazy dog STOP"] * 3,
                            trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    spec["decoder"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}
    if decoder == "strip":
        vocab = spec["model"]["vocab"]
        for b in range(256):                 # the byte tokens, in the vocab as Llama's are
            vocab.setdefault(f"<0x{b:02X}>", len(vocab))
        spec["model"]["byte_fallback"] = True
        tok2 = Tokenizer(models.BPE())
        tok2.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                          decoders.Strip(" ", 1, 0)])
        spec["decoder"] = json.loads(tok2.to_str())["decoder"]
    (path / "tokenizer.json").write_text(json.dumps(spec))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return load_tokenizer(path)


@pytest.fixture(scope="module", params=["default-model", "tiny-v4", "tiny-v4-markup-special",
                                        "sentencepiece-strip", "sentencepiece-metaspace"])
def hf_tokenizer(request, tmp_path_factory):
    from tests.helpers import write_v4_tokenizer

    from kvmesh.workers.checkpoint.default_model import default_model_dir
    from kvmesh.workers.checkpoint.tokenizer import HFTokenizer, load_tokenizer
    path = tmp_path_factory.mktemp(request.param)
    tok = load_tokenizer(default_model_dir()) if request.param == "default-model" else \
        load_tokenizer(write_v4_tokenizer(path, markup_special=request.param.endswith("special"))) \
        if request.param.startswith("tiny") else sentencepiece_tokenizer(path, request.param.split("-")[1])
    assert isinstance(tok, HFTokenizer)
    return request.param, tok


def random_ids(rng: random.Random, tok) -> list[int]:
    """Encoded text (multi-byte characters, stop strings, markup), random ids (characters cut
    mid-way, byte tokens, BOS/EOS/pad)."""
    ids: list[int] = []
    for _ in range(rng.randint(1, 8)):
        kind = rng.random()
        if kind < 0.6:
            ids += tok.encode_rendered("".join(rng.choices(UNICODE_TEXT, k=rng.randint(1, 3))))
        elif kind < 0.9:
            ids += [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 4))]
        else:
            ids += [rng.choice(sorted(tok._dropped))]
    return ids


def run_through(d: Detokenizer, ids: list[int], rng: random.Random) -> list[str]:
    deltas, i = [], 0
    while i < len(ids) and not d.stopped:
        n = rng.choice([1, 1, 1, 2, 3, 7])
        deltas.append(d.add(ids[i:i + n]))
        i += n
    return deltas + [d.finish()]


def test_decode_stream_gives_the_python_windows_deltas(hf_tokenizer):
    name, tok = hf_tokenizer
    rng, kept = random.Random(f"decode-stream-{name}"), 0
    for trial in range(300):
        ids, stops = random_ids(rng, tok), rng.sample(STOPS, rng.randint(0, 3))
        markup, seed = trial % 2 == 1, rng.random()
        decode = tok.decode_markup if markup else tok.decode
        old = Detokenizer(decode, stops)
        new = Detokenizer(decode, stops, tok.decode_stream(markup=markup))
        want = run_through(old, ids, random.Random(seed))
        assert run_through(new, ids, random.Random(seed)) == want, (ids, stops, markup)
        assert (new.text, new.stopped, new.token_ids) == (old.text, old.stopped, old.token_ids)
        assert all(REPLACEMENT not in d for d in want[:-1]) or REPLACEMENT in decode(ids)
        kept += new._stream is not None
    if name == "sentencepiece-strip":   # ByteFallback's odd windows (see Detokenizer) hand over to decode
        assert 150 <= kept < 300
    else:
        assert kept == 300                # DecodeStream throughout


def test_decode_stream_holds_back_partial_characters_and_stop_tails(hf_tokenizer):
    _, tok = hf_tokenizer
    for text, stopped in (("héllo 日本語 and ST", False), ("héllo 日本語 and STOP more", True)):
        d = Detokenizer(tok.decode, ["STOP"], tok.decode_stream())
        deltas = [d.add([t]) for t in tok.encode_rendered(text) if not d.stopped]
        assert all(REPLACEMENT not in x for x in deltas) and not "".join(deltas).endswith("S")
        assert "".join(deltas) + d.finish() == ("héllo 日本語 and " if stopped else text) and d.stopped == stopped
        assert d._stream is not None


def test_a_raising_stream_hands_over_to_decode_at_the_same_offsets():
    calls = []

    def step(ids):
        calls.append(ids)
        if len(calls) == 3:
            raise Exception("Invalid prefix encountered while decoding stream")
        return TOK.decode(ids) if all(t < 128 + 3 for t in ids) else None
    ids = TOK.encode("ab€cd")
    d = Detokenizer(TOK.decode, [], step)
    deltas = [d.add([t]) for t in ids]
    assert "".join(deltas) + d.finish() == "ab€cd" and d._stream is None and len(calls) == 3


def test_a_reply_streams_through_decode_stream_for_a_tokenizer_json_only(hf_tokenizer):
    from kvmesh.cluster.openai.responses import Choice, ReplyFormat
    _, tok = hf_tokenizer
    assert Choice(0, tok, ["x"]).detok._stream is not None
    assert Choice(0, tok, [], fmt=ReplyFormat("chat", tools=False)).detok._stream is not None
    assert Choice(0, TOK, ["x"]).detok._stream is None          # bytes: decode's windows, as before
