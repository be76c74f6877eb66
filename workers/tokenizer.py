"""Tokenizers: `tokenizer.json` through the `tokenizers` library, or bytes for checkpoints
that ship none."""
from __future__ import annotations

import json
from pathlib import Path

BYTE_OFFSET = 3   # ids 0,1,2 = bos, eos, pad; byte b -> b + 3


class Tokenizer:
    """Common interface: encode / decode / chat template."""

    vocab_size: int
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes shifted past three special ids; ids beyond the byte range decode to nothing."""

    vocab_size = 256 + BYTE_OFFSET

    def encode(self, text: str) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < 256 + BYTE_OFFSET)
        return data.decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tok
        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        cfg = path.parent / "tokenizer_config.json"
        if cfg.exists():
            self.chat_template = json.loads(cfg.read_text()).get("chat_template")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    return HFTokenizer(path) if path.exists() else ByteTokenizer()
