"""Tokenizers: `tokenizer.json` through the `tokenizers` library, or bytes for checkpoints
that ship none.

`encode(text)` is a *prompt* encoding and adds BOS/EOS exactly as transformers (v5) does for
these files: tokenizer.json's post-processor decides (transformers ignores tokenizer_config's
`add_bos_token` / `add_eos_token` when a tokenizer.json exists).
`encode_rendered(text)` adds nothing (a rendered chat template carries its own BOS).
`encode_segments(pieces)` is `encode_rendered` of a prompt cut into markup and content: the
tokenizer's added tokens (`<｜User｜>`, `</think>`, ...) are read in markup only, content is text
through and through (llama.cpp's `parse_special=false`). Runs of text between markup's added
tokens are encoded whole, so a prompt whose content holds no added token's string gets exactly
the ids `encode_rendered` gives (added tokens are matched as written: a tokenizer whose added
tokens set lstrip / rstrip / single_word would split differently; the default and test
tokenizers set none). Encoding releases the GIL
(`encode_batch_fast`): a long prompt tokenized on a worker thread leaves the event loop running.
The chat template is `chat_template.jinja` or tokenizer_config.json's `chat_template`;
generation ends on the tokenizer's EOS and generation_config.json's `eos_token_id`s.
`chat_format` says how chat prompts are made: "template", "dsv4" (a DeepSeek-V4 checkpoint
without a template whose tokenizer has V4's turn tokens: the format DeepSeek's encoder
defines, cluster/chat/dsv4_encode.py) or "plain".
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

BYTE_OFFSET = 3   # ids 0,1,2 = bos, eos, pad; byte b -> b + 3
DSV4_TURN_TOKENS = ("<｜User｜>", "<｜Assistant｜>")   # one id each in a tokenizer made for V4's format


class Tokenizer:
    """Common interface: encode / decode / chat template."""

    vocab_size: int
    chat_template: str | None = None
    special_tokens: dict[str, str] = {}      # bos_token, eos_token, ... as the template sees them
    stop_token_ids: tuple[int, ...] = ()     # end-of-turn ids (the tokenizer's EOS)
    chat_format: str = "plain"

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_rendered(self, text: str) -> list[int]:
        return self.encode(text)

    def encode_segments(self, pieces: list[tuple[str, bool]], special_in_content: bool = False) -> list[int]:
        """`encode_rendered` of the pieces joined, where a piece marked content (True) never yields
        an added token's id unless `special_in_content` (DeepSeek's raw behaviour)."""
        return self.encode_rendered("".join(text for text, _ in pieces))

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def decode_markup(self, ids: list[int]) -> str:
        """Text with the format's markup tokens kept (`</think>`, ...), BOS/EOS/pad dropped."""
        return self.decode(ids)

    def decode_stream(self, markup: bool = False):
        """A native incremental decoder for `decode` (`decode_markup` if `markup`): a fresh
        `step(ids) -> str | None` (cluster/chat/detokenizer.py), or None where there is none."""
        return None


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes shifted past three special ids; ids beyond the byte range decode to nothing."""

    vocab_size = 256 + BYTE_OFFSET

    def encode(self, text: str) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < 256 + BYTE_OFFSET)
        return data.decode("utf-8", errors="replace")


SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class HFTokenizer(Tokenizer):
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tok
        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        cfg_path = path.parent / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        jinja = path.parent / "chat_template.jinja"
        self.chat_template = jinja.read_text() if jinja.exists() else cfg.get("chat_template")
        self.special_tokens = {k: t for k in SPECIAL_KEYS if (t := _token_text(cfg.get(k))) is not None}
        self.bos_id, self.eos_id = (self._id(self.special_tokens.get(k)) for k in ("bos_token", "eos_token"))
        gen_path = path.parent / "generation_config.json"
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.exists() else None
        gen_eos = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
        ends = ([] if self.eos_id is None else [self.eos_id]) + [int(i) for i in gen_eos]
        self.stop_token_ids = tuple(dict.fromkeys(ends))     # the tokenizer's EOS + generation_config's
        self._dropped = {i for i in (self.bos_id, self.eos_id, self._id(_token_text(cfg.get("pad_token"))))
                         if i is not None}
        self.chat_format = "template" if self.chat_template else \
            "dsv4" if _model_type(path.parent) == "deepseek_v4" and self._has_v4_turns() else "plain"
        self._added = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
        self._added_re = re.compile("|".join(re.escape(t) for t in sorted(self._added, key=len, reverse=True))) \
            if self._added else None

    @functools.cached_property
    def _text_only(self):
        """A copy of the tokenizer that reads every string as text: no added tokens (BOS, turn
        tokens, ...). Built on first use: only the ingress encodes segments."""
        from tokenizers import Tokenizer as _Tok
        spec = json.loads(self._tok.to_str())
        spec["added_tokens"] = []
        return _Tok.from_str(json.dumps(spec))

    def _has_v4_turns(self) -> bool:
        return all(len(self._tok.encode(t, add_special_tokens=False).ids) == 1 for t in DSV4_TURN_TOKENS)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode_batch_fast([text], add_special_tokens=True)[0].ids

    def encode_rendered(self, text: str) -> list[int]:
        return self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def encode_segments(self, pieces: list[tuple[str, bool]], special_in_content: bool = False) -> list[int]:
        if special_in_content or self._added_re is None:
            return super().encode_segments(pieces)
        runs: list[list[str]] = [[]]         # text between markup's added tokens
        specials: list[int] = []             # the added token after each run but the last
        for text, content in pieces:
            pos = 0
            for m in () if content else self._added_re.finditer(text):
                runs[-1].append(text[pos:m.start()])
                specials.append(self._added[m.group()])
                runs.append([])
                pos = m.end()
            runs[-1].append(text[pos:])
        encoded = self._text_only.encode_batch_fast(["".join(r) for r in runs], add_special_tokens=False)
        ids = list(encoded[0].ids)
        for special, run in zip(specials, encoded[1:]):
            ids.append(special)
            ids += run.ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decode_markup(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if i not in self._dropped], skip_special_tokens=False)

    def decode_stream(self, markup: bool = False):
        """`tokenizers`' DecodeStream: the detokenizer's prefix/read-offset windows decoded in Rust,
        with what `decode` (`decode_markup`: BOS/EOS/pad dropped first) decodes."""
        from tokenizers.decoders import DecodeStream
        stream, tok, dropped = DecodeStream(skip_special_tokens=not markup), self._tok, self._dropped

        def step(ids: list[int]) -> str | None:
            if markup:
                ids = [i for i in ids if i not in dropped]
            return stream.step(tok, ids) if ids else None
        return step


def _model_type(model_dir: Path) -> str | None:
    cfg = model_dir / "config.json"
    return json.loads(cfg.read_text()).get("model_type") if cfg.exists() else None


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    return HFTokenizer(path) if path.exists() else ByteTokenizer()
