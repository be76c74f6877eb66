"""The incremental detokenizer (cluster/chat/detokenizer.py): text deltas concatenate to the
decoded text and hold back partial UTF-8, stop strings end the text before them (across
chunks, the earliest of several), and each token decodes a bounded window."""
from __future__ import annotations

from kvmesh.cluster.chat.detokenizer import Detokenizer
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
