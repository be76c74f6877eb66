"""Structured output: grammar-constrained decoding with xgrammar (the library vLLM and
SGLang use; maintained, CPU and CUDA, compiles a JSON schema once into a token-mask
automaton so each step costs one mask fill, not a vocabulary scan in Python). Schema
output is compact JSON (no free whitespace between tokens), so a model cannot stall in
an endless run of blanks.

    compiler = GuideCompiler(tokenizer, vocab_size, eos_ids)
    guide = compiler.guide(("json_schema", schema_json))    # or ("json_object", ""); waits for the compile
    future = compiler.compile_async(spec)                   # never blocks: Guide(future.result(), V) once done
    bits = token_bitmask(rows, V)    # one packed int32 [rows, ceil(V/32)] mask for a step's guided rows
    guide.fill(bits, i)              # row i <- the tokens the grammar accepts next (xgrammar's fill)
    apply_token_bitmask(logits, bits, [i, ...], V)   # one batched in-place op: refused tokens -> -inf
    guide.accept(token); guide.done  # True once the grammar is complete and a stop token was taken

The sampler masks all guided rows of a step with one bitmask and one op, as vLLM and SGLang do
(xgrammar's kernel on CUDA; on the host a numpy unpack and one index_add_, faster than xgrammar's
CPU loop); `Guide.allowed()` (a bool [V]) is for
inspection and tests only.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch

from .compile_pool import CompilePool
from .grammar_worker import CompileBudgetExceeded
from .params import InvalidRequestError, check_schema_size

GUIDE_KINDS = ("json_object", "json_schema", "ebnf")      # ebnf: a grammar the API layer wrote (tool calls)
JSON_OBJECT_SCHEMA = '{"type": "object"}'     # what json_object compiles (vLLM compiles the same)


class Guide:
    """One sequence's position in a compiled grammar."""

    def __init__(self, grammar, vocab_size: int):
        import xgrammar as xgr
        self.grammar, self.vocab_size = grammar, vocab_size
        self.matcher = xgr.GrammarMatcher(grammar)

    def fresh(self) -> "Guide":
        """The same grammar from its start (an n > 1 fork's own state; no compile, no cache)."""
        return Guide(self.grammar, self.vocab_size)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of a packed bitmask (token_bitmask) <- the tokens the grammar accepts next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar accepts next (inspection and tests; the sampler
        uses the packed mask)."""
        bits = token_bitmask(1, self.vocab_size)
        self.fill(bits, 0)
        return unpack_bitmask(bits, self.vocab_size)[0]

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()


def token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A packed mask int32 [rows, ceil(vocab_size / 32)] on the host, every token allowed
    (xgrammar's layout: bit j % 32 of word j // 32 is token j)."""
    import xgrammar as xgr
    return xgr.allocate_token_bitmask(rows, vocab_size)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size] of a packed mask (little-endian bits)."""
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1
    return bits.bool().reshape(bitmask.shape[0], -1)[:, :vocab_size]


_BACKEND: list[str] = []       # xgrammar's backend for CUDA logits: "auto" (triton) unless it cannot load


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """In place: logits[r, t] = -inf for every row r in `rows` and token t that bitmask[r] refuses,
    for all rows at once: on CUDA xgrammar's apply_token_bitmask_inplace (a Triton kernel); on
    the host `_apply_on_host`. Logit columns past `vocab_size` (a padded vocabulary) are refused too."""
    import xgrammar as xgr
    width = logits.shape[1]
    vocab = min(vocab_size, width)
    if logits.device.type == "cpu":
        _apply_on_host(logits, bitmask, rows, vocab)
    else:
        bits = bitmask.to(logits.device, non_blocking=True)
        indices = None if len(rows) == logits.shape[0] == bitmask.shape[0] else rows
        if not _BACKEND:
            try:
                import triton  # noqa: F401    xgrammar's CUDA path is a triton kernel
                _BACKEND.append("auto")
            except ImportError:
                _BACKEND.append("torch_native")
        xgr.apply_token_bitmask_inplace(logits, bits, vocab_size=vocab, indices=indices, backend=_BACKEND[0])
    if width > vocab_size:
        logits[rows, vocab_size:] = float("-inf")


def _apply_on_host(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> None:
    """apply_token_bitmask for host logits. xgrammar's CPU op is a scalar loop per token (16 ms
    for 32 rows of V4's 129,280-token vocabulary on this project's CPU, its torch_native one 9 ms,
    the bool [V] mask per row it replaced 6 ms): here the guided rows' words are unpacked at once
    (numpy.unpackbits, little-endian bits as xgrammar packs them) into offsets, 0 where a token is
    allowed and -inf where it is not (-max * 2 overflows to -inf), added to those rows in one
    index_add_: 2 ms (bench/guided.py). Allowed logits are unchanged (x + 0 == x)."""
    index = torch.tensor(rows)
    words = bitmask if len(rows) == bitmask.shape[0] else bitmask[index]
    bits = torch.from_numpy(np.unpackbits(words.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little"))
    offsets = bits.to(logits.dtype).sub_(1).mul_(torch.finfo(logits.dtype).max).mul_(2)
    logits[:, :vocab].index_add_(0, index, offsets)


class GrammarLimits(NamedTuple):
    """What one request's schema may cost, and how many compile at once (EngineConfig:
    max_schema_bytes, grammar_compile_timeout_s, grammar_compile_memory_bytes,
    grammar_compile_workers)."""

    max_schema_bytes: int = 64 << 10
    compile_timeout_s: float = 10.0
    compile_memory_bytes: int = 2 << 30
    compile_workers: int | None = None      # None: compile_pool.default_size()


class GrammarStats(NamedTuple):
    """The compiler's counters (workers.engine.stats.GrammarCounters exports them)."""
    processes: int = 0        # compiler processes up now
    running: int = 0          # compiles in a child process now
    queued: int = 0           # compiles waiting for a child
    compiles: int = 0         # compiles that ended since start
    cache_hits: int = 0       # requests whose grammar was compiled already
    coalesced: int = 0        # requests that joined an identical compile in progress
    budget_kills: int = 0     # compiles stopped at their time or memory budget
    refusals_remembered: int = 0    # requests refused from memory: their grammar was refused before
    preempted: int = 0        # compiles stopped after their slice for a shorter one, and queued again


CACHE_ENTRIES = 64            # compiled grammars kept, least recently used dropped first
CACHE_BYTES = 256 << 20       # ... and at most this much of their memory (xgrammar's memory_size_bytes)
REFUSED_ENTRIES = 4096        # refused grammars remembered (a 16-byte hash and the error each), oldest dropped first


def _refusal_key(spec: tuple[str, str]) -> bytes:
    """A refused grammar's key: 16 bytes of BLAKE2b over its kind and text (the text itself,
    up to max_schema_bytes, is not kept)."""
    kind, text = spec
    return hashlib.blake2b(f"{kind}\0{text}".encode(), digest_size=16).digest()


class GuideCompiler:
    """Compiles grammars for one tokenizer (lazily: xgrammar loads on the first guided request).

    A schema over `limits.max_schema_bytes` is refused before any work; the others compile in
    a pool of child processes (workers.sampling.compile_pool: several at once, a small schema
    never queued behind large ones) inside the time and memory budget, so no request can stall
    or exhaust the engine's process; over budget is an InvalidRequestError naming
    `response_format` and the limit (a 400, never retried). Compiled grammars are kept in a
    bounded LRU cache keyed by (kind, text) (the API layer sends canonical JSON, see
    check_schema), so a repeated schema does not compile again, and requests for a grammar
    being compiled wait on that one compile. A grammar refused (past its budget, or not
    compilable) is remembered by the hash of (kind, text), bounded: sent again it is refused
    with the same error at once, never compiled again (one client resending slow schemas
    costs their compile once). Thread-safe; `compile_async` never blocks on a
    compile (the async engine and data-parallel ranks wait for its future off the step)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, limits: GrammarLimits = GrammarLimits()):
        self.tokenizer, self.vocab_size, self.eos, self.limits = tokenizer, vocab_size, list(eos_token_ids), limits
        self._info = None
        self._info_lock = threading.Lock()
        self._pool: CompilePool | None = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._pending: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._refused: OrderedDict[bytes, InvalidRequestError] = OrderedDict()
        self._hits = self._coalesced = self._refused_hits = 0

    def _tokenizer_info(self):
        import xgrammar as xgr
        hf = getattr(self.tokenizer, "_tok", None)
        if hf is not None:
            from transformers import PreTrainedTokenizerFast
            return xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=hf),
                                                      vocab_size=self.vocab_size, stop_token_ids=self.eos)
        from kvmesh.workers.checkpoint.tokenizer import BYTE_OFFSET
        vocab = [b""] * BYTE_OFFSET + [bytes([b]) for b in range(256)]   # the byte tokenizer: raw bytes
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=self.eos)

    def _info_json(self) -> str:
        """xgrammar's TokenizerInfo, serialized (the pool calls this in its own thread: the
        import and the vocabulary take seconds, which no engine step may wait for)."""
        with self._info_lock:
            if self._info is None:
                self._info = self._tokenizer_info()
            return self._info.serialize_json()

    def _started(self) -> CompilePool:
        with self._lock:
            if self._pool is None:
                lim = self.limits
                self._pool = CompilePool(self._info_json, lim.compile_workers, lim.compile_timeout_s,
                                         lim.compile_memory_bytes)
            return self._pool

    def compile_async(self, spec: tuple[str, str], client: str = "") -> concurrent.futures.Future:
        """A future of the compiled grammar of `spec` (done already when cached); it raises
        InvalidRequestError when the grammar is unusable or over its budget. An unknown kind or
        a schema over the size limit raises here, before any work. `client`: whose compile it
        is (the pool shares its children between clients; a coalesced request joins the first's)."""
        kind, schema = spec
        if kind not in GUIDE_KINDS:
            raise InvalidRequestError(f"unknown type {kind!r}", "response_format")
        check_schema_size(schema, self.limits.max_schema_bytes, None if kind == "ebnf" else "response_format")
        with self._lock:
            known = self._known(spec)
            if known is not None:
                return known
            self._pending[spec] = out = concurrent.futures.Future()
            out.set_running_or_notify_cancel()    # shared by every waiter: one leaving cannot cancel it
        try:
            text = JSON_OBJECT_SCHEMA if kind == "json_object" else schema   # JSON mode: an *object* (as vLLM)
            raw = self._started().submit(text, "ebnf" if kind == "ebnf" else "json_schema", client)
        except BaseException as e:
            self._settle(spec, out, None, e)
            raise
        raw.add_done_callback(lambda f: self._finished(spec, f, out))
        return out

    def known(self, spec: tuple[str, str]) -> concurrent.futures.Future | None:
        """`spec`'s future when that costs no compile: done when cached or refused before, the
        compile in progress when one is; None when asking would start a compile. Counts a refusal
        from memory (the request ends there), not a cache hit or a join (compile_async counts
        those when the request asks)."""
        with self._lock:
            return self._known(spec, count=False)

    def _known(self, spec: tuple[str, str], count: bool = True) -> concurrent.futures.Future | None:
        refused = self._refused.get(_refusal_key(spec))
        if refused is not None:
            self._refused_hits += 1
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_exception(InvalidRequestError(refused.message, refused.field))
            return failed
        if spec in self._compiled:
            self._compiled.move_to_end(spec)
            self._hits += count
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(self._compiled[spec])
            return done
        if spec in self._pending:
            self._coalesced += count
            return self._pending[spec]
        return None

    def _finished(self, spec: tuple[str, str], raw: concurrent.futures.Future, out) -> None:
        """A pool compile ended (in the pool's thread): deserialize, cache, answer every waiter."""
        kind = spec[0]
        # an ebnf guide is written by the API layer: from `tools`, or `response_format` in thinking mode
        field, what = ((None, "the grammar of the request's tools / response_format") if kind == "ebnf"
                       else ("response_format", "the JSON schema"))
        refused = True      # the grammar's own fault: remembered, refused again at once
        try:
            import xgrammar as xgr
            grammar, error = xgr.CompiledGrammar.deserialize_json(raw.result(), self._info), None
        except ValueError as e:
            grammar, error = None, InvalidRequestError(f"{what} cannot be compiled: {e}", field)
        except CompileBudgetExceeded as e:
            grammar, error = None, InvalidRequestError(
                f"compiling {what} exceeded its {e} (engine.grammar_compile_timeout_s / "
                f"engine.grammar_compile_memory_bytes); simplify the schema", field)
        except BaseException as e:        # the pool closed under it: not the grammar's fault
            grammar, error, refused = None, e, False
        self._settle(spec, out, grammar, error, refused)

    def _settle(self, spec: tuple[str, str], out, grammar, error: BaseException | None,
                refused: bool = False) -> None:
        with self._lock:
            self._pending.pop(spec, None)
            if error is None:
                self._remember(spec, grammar)
            elif refused:
                self._refused[_refusal_key(spec)] = error
                while len(self._refused) > REFUSED_ENTRIES:
                    self._refused.popitem(last=False)
        out.set_result(grammar) if error is None else out.set_exception(error)

    def _remember(self, spec: tuple[str, str], grammar) -> None:
        """Cache `grammar` (the lock held), dropping the least recently used past the bounds."""
        self._compiled[spec] = grammar
        while len(self._compiled) > CACHE_ENTRIES or (
                len(self._compiled) > 1 and sum(g.memory_size_bytes for g in self._compiled.values()) > CACHE_BYTES):
            self._compiled.popitem(last=False)

    def compile(self, spec: tuple[str, str]):
        """The compiled grammar of `spec`, waiting for its compile (InvalidRequestError as above)."""
        return self.compile_async(spec).result()

    def cached(self) -> int:
        with self._lock:
            return len(self._compiled)

    def guide(self, spec: tuple[str, str]) -> Guide:
        return Guide(self.compile(spec), self.vocab_size)

    def stats(self) -> GrammarStats:
        pool = self._pool.stats() if self._pool is not None else None
        with self._lock:
            hits, coalesced, refused = self._hits, self._coalesced, self._refused_hits
        if pool is None:
            return GrammarStats(cache_hits=hits, coalesced=coalesced, refusals_remembered=refused)
        return GrammarStats(pool.processes, pool.running, pool.queued, pool.compiled, hits, coalesced,
                            pool.budget_kills, refused, pool.preempted)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
