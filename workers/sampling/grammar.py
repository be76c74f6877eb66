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
import threading
from collections import OrderedDict
from typing import NamedTuple

import torch

from .grammar_worker import CompileBudgetExceeded, CompileWorker
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


class GrammarLimits(NamedTuple):
    """What one request's schema may cost (EngineConfig: max_schema_bytes,
    grammar_compile_timeout_s, grammar_compile_memory_bytes)."""

    max_schema_bytes: int = 64 << 10
    compile_timeout_s: float = 10.0
    compile_memory_bytes: int = 2 << 30


CACHE_ENTRIES = 64            # compiled grammars kept, least recently used dropped first
CACHE_BYTES = 256 << 20       # ... and at most this much of their memory (xgrammar's memory_size_bytes)


class GuideCompiler:
    """Compiles grammars for one tokenizer (lazily: xgrammar loads on the first guided request).

    A schema over `limits.max_schema_bytes` is refused before any work; the others compile in
    a child process (workers.sampling.grammar_worker) inside the time and memory budget, so no
    request can stall or exhaust the engine's process; over budget is an InvalidRequestError
    naming `response_format` and the limit (a 400, never retried). Compiled grammars are kept
    in a bounded LRU cache by spec. Thread-safe: the async engine compiles off its loop thread
    and the loop then finds the grammar cached."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, limits: GrammarLimits = GrammarLimits()):
        self.tokenizer, self.vocab_size, self.eos, self.limits = tokenizer, vocab_size, list(eos_token_ids), limits
        self._info = None
        self._worker: CompileWorker | None = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()

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

    def _started(self) -> None:
        with self._lock:
            if self._info is None:
                self._info = self._tokenizer_info()
                self._worker = CompileWorker(self._info.serialize_json(), self.limits.compile_timeout_s,
                                             self.limits.compile_memory_bytes)

    def compile(self, spec: tuple[str, str]):
        kind, schema = spec
        if kind not in GUIDE_KINDS:
            raise InvalidRequestError(f"unknown type {kind!r}", "response_format")
        check_schema_size(schema, self.limits.max_schema_bytes, None if kind == "ebnf" else "response_format")
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        self._started()
        if kind == "json_object":      # a JSON *object*, as OpenAI's JSON mode promises (not any value)
            schema = JSON_OBJECT_SCHEMA
        # an ebnf guide is written by the API layer: from `tools`, or `response_format` in thinking mode
        field, what = ((None, "the grammar of the request's tools / response_format") if kind == "ebnf"
                       else ("response_format", "the JSON schema"))
        import xgrammar as xgr
        try:
            compiled = self._worker.compile(schema, "ebnf" if kind == "ebnf" else "json_schema")
            grammar = xgr.CompiledGrammar.deserialize_json(compiled, self._info)
        except ValueError as e:
            raise InvalidRequestError(f"{what} cannot be compiled: {e}", field) from None
        except CompileBudgetExceeded as e:
            raise InvalidRequestError(
                f"compiling {what} exceeded its {e} (engine.grammar_compile_timeout_s / "
                f"engine.grammar_compile_memory_bytes); simplify the schema", field) from None
        self._remember(spec, grammar)
        return grammar

    def _remember(self, spec: tuple[str, str], grammar) -> None:
        with self._lock:
            self._compiled[spec] = grammar
            while len(self._compiled) > CACHE_ENTRIES or (
                    len(self._compiled) > 1 and sum(g.memory_size_bytes for g in self._compiled.values()) > CACHE_BYTES):
                self._compiled.popitem(last=False)

    def cached(self) -> int:
        with self._lock:
            return len(self._compiled)

    def guide(self, spec: tuple[str, str]) -> Guide:
        import xgrammar as xgr
        return Guide(xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()


def check_schema_size(schema: str, max_bytes: int, field: str | None = "response_format") -> None:
    """InvalidRequestError (naming `field` and the limit) for a schema over `max_bytes`."""
    size = len(schema.encode())
    if size > max_bytes:
        what = {"response_format": "the JSON schema", "tools": "the tools' grammar"}.get(
            field, "the grammar of the request's tools / response_format")
        raise InvalidRequestError(f"{what} is {size} bytes, over the limit of {max_bytes} "
                                  f"(engine.max_schema_bytes)", field)


def check_schema(schema: object) -> str:
    """A JSON schema (dict) -> its canonical JSON text; the API layer calls this."""
    if not isinstance(schema, dict):
        raise InvalidRequestError("must be a JSON object", "response_format.json_schema.schema")
    return json.dumps(schema, sort_keys=True)
