"""Tokenizers: `tokenizer.json` through the `tokenizers` library, or bytes for checkpoints
that ship none.

`encode(text)` is a *prompt* encoding and adds BOS/EOS exactly as transformers (v5) does for
these files: tokenizer.json's post-processor decides (transformers ignores tokenizer_config's
`add_bos_token` / `add_eos_token` when a tokenizer.json exists).
`encode_rendered(text)` adds nothing (a rendered chat template carries its own BOS).
The chat template is `chat_template.jinja` or tokenizer_config.json's `chat_template`;
generation ends on the tokenizer's EOS and generation_config.json's `eos_token_id`s.
`chat_format` says how chat prompts are made: "template", "dsv4" (a DeepSeek-V4 checkpoint
without a template whose tokenizer has V4's turn tokens: the format DeepSeek's encoder
defines, cluster/chat/dsv4_encode.py) or "plain".
"""
from __future__ import annotations

import json
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

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def decode_markup(self, ids: list[int]) -> str:
        """Text with the format's markup tokens kept (`</think>`, ...), BOS/EOS/pad dropped."""
        return self.decode(ids)


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

    def _has_v4_turns(self) -> bool:
        return all(len(self._tok.encode(t, add_special_tokens=False).ids) == 1 for t in DSV4_TURN_TOKENS)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_rendered(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decode_markup(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if i not in self._dropped], skip_special_tokens=False)


def _model_type(model_dir: Path) -> str | None:
    cfg = model_dir / "config.json"
    return json.loads(cfg.read_text()).get("model_type") if cfg.exists() else None


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    return HFTokenizer(path) if path.exists() else ByteTokenizer()
