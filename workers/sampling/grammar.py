"""Structured output: grammar-constrained decoding with xgrammar (the library vLLM and
SGLang use; maintained, CPU and CUDA, compiles a JSON schema once into a token-mask
automaton so each step costs one mask fill, not a vocabulary scan in Python). Schema
output is compact JSON (no free whitespace between tokens), so a model cannot stall in
an endless run of blanks.

    compiler = GuideCompiler(tokenizer, vocab_size, eos_ids)
    guide = compiler.guide(("json_schema", schema_json))    # or ("json_object", "")
    allowed = guide.allowed()        # bool [V]: the tokens the grammar accepts next
    guide.accept(token); guide.done  # True once the grammar is complete and a stop token was taken
"""
from __future__ import annotations

import json

import torch

from .params import InvalidRequestError

GUIDE_KINDS = ("json_object", "json_schema", "ebnf")      # ebnf: a grammar the API layer wrote (tool calls)
JSON_OBJECT_SCHEMA = '{"type": "object"}'     # what json_object compiles (vLLM compiles the same)


class Guide:
    """One sequence's position in a compiled grammar."""

    def __init__(self, matcher, vocab_size: int):
        import xgrammar as xgr
        self.matcher, self.vocab_size = matcher, vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._bits = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        self.matcher.fill_next_token_bitmask(self._bitmask, 0)
        bits = (self._bitmask[0, :, None] >> self._bits) & 1        # [words, 32], little-endian bits
        return bits.bool().reshape(-1)[:self.vocab_size]

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()


class GuideCompiler:
    """Compiles grammars for one tokenizer (lazily: xgrammar loads on the first guided request);
    compiled grammars are cached by their spec."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, list(eos_token_ids)
        self._compiler = None
        self._compiled: dict[tuple[str, str], object] = {}

    def _tokenizer_info(self):
        import xgrammar as xgr
        hf = getattr(self.tokenizer, "_tok", None)
        if hf is not None:
            from transformers import PreTrainedTokenizerFast
            return xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=hf),
                                                      vocab_size=self.vocab_size, stop_token_ids=self.eos)
        from workers.checkpoint.tokenizer import BYTE_OFFSET
        vocab = [b""] * BYTE_OFFSET + [bytes([b]) for b in range(256)]   # the byte tokenizer: raw bytes
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=self.eos)

    def compile(self, spec: tuple[str, str]):
        if spec not in self._compiled:
            import xgrammar as xgr
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(self._tokenizer_info())
            kind, schema = spec
            if kind not in GUIDE_KINDS:
                raise InvalidRequestError(f"unknown type {kind!r}", "response_format")
            try:
                if kind == "ebnf":
                    self._compiled[spec] = self._compiler.compile_grammar(schema)
                else:
                    if kind == "json_object":      # a JSON *object*, as OpenAI's JSON mode promises (not any value)
                        schema = JSON_OBJECT_SCHEMA
                    self._compiled[spec] = self._compiler.compile_json_schema(schema, any_whitespace=False)
            except Exception as e:  # xgrammar raises RuntimeError / ValueError on an unusable schema
                if kind == "ebnf":
                    raise InvalidRequestError(f"the tools' schemas cannot be compiled: {e}", "tools") from None
                raise InvalidRequestError(f"the JSON schema cannot be compiled: {e}", "response_format") from None
        return self._compiled[spec]

    def guide(self, spec: tuple[str, str]) -> Guide:
        import xgrammar as xgr
        return Guide(xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)


def check_schema(schema: object) -> str:
    """A JSON schema (dict) -> its canonical JSON text; the API layer calls this."""
    if not isinstance(schema, dict):
        raise InvalidRequestError("must be a JSON object", "response_format.json_schema.schema")
    return json.dumps(schema, sort_keys=True)
