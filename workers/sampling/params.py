"""Sampling parameters (validated once) and the one-row sampler (`kvmesh.workers.sampling.sampler` batches it)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1   # int64, as OpenAI-style APIs take seeds
MAX_N = 16
MAX_TOP_LOGPROBS = 20


class InvalidRequestError(ValueError):
    """A request the engine refuses (HTTP 400). `field` is the offending request field (the
    OpenAI error's `param`), and the message starts with it: "max_tokens: must be >= 1"."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.message, self.field = message, field

    def __reduce__(self):     # keeps `field` across processes (Ray pickles the worker's error)
        return type(self), (self.message, self.field)


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) exceeds the model's context limit."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = True
    top_logprobs: int = 0           # alternatives reported per output token (under the raw distribution)
    n: int = 1                      # sequences forked from one prefill
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (CTRL / HF semantics)
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    guide: tuple[str, str] | None = None   # ("json_object" | "json_schema", schema JSON): workers.sampling.grammar
    prompt_logprobs: int | None = None     # echo: logprob (+ this many alternatives) of every prompt token

    def validate(self) -> "SamplingParams":
        def bad(field: str, why: str):
            raise InvalidRequestError(why, field)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check_real("temperature", self.temperature)
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        _check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", f"must be a 64-bit signed integer, got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be a list of non-negative integer token ids, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", f"{self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) or not (
                0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or not isinstance(
                self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check_real(name, v)
            if not -2.0 <= v <= 2.0:
                bad(name, f"must be in [-2, 2], got {v!r}")
        _check_real("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        _check_real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for pair in self.logit_bias:
            if len(pair) != 2 or isinstance(pair[0], bool) or not isinstance(pair[0], int) or pair[0] < 0:
                bad("logit_bias", f"must map token ids >= 0 to biases in [-100, 100], got {pair!r}")
            _check_real("logit_bias", pair[1], f"the bias of token {pair[0]}")
            if not -100.0 <= pair[1] <= 100.0:
                bad("logit_bias", f"the bias of token {pair[0]} must be in [-100, 100], got {pair[1]!r}")
        return self

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _check_real(field: str, value: object, subject: str = "") -> None:
    """InvalidRequestError unless `value` (of `field`; `subject` names it within the field) is a
    finite int or float. NaN fails every range check, so it would otherwise be refused by a bound
    it does not break ("must be in [0, 100]"); JSON's NaN and Infinity reach here from
    `kvmesh generate`'s lines. A bool is no number here."""
    must = f"{subject} must" if subject else "must"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{must} be a number, got {value!r}", field)
    if not math.isfinite(value):
        raise InvalidRequestError(f"{must} be a finite number, got {value!r}", field)


def make_generator(params: SamplingParams, index: int = 0) -> torch.Generator | None:
    """The seeded generator of sequence `index` of a request (each of n forks draws its own)."""
    if params.temperature == 0.0 or params.seed is None:
        return None
    import torch    # not at import: the API layer validates params without torch
    return torch.Generator().manual_seed((params.seed + index) % (1 << 64))


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
