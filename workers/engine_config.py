"""EngineConfig: every engine setting, its default, its help and its check, in one place.

    EngineConfig(model=DIR, kv_cache_bytes="64MiB", swa_policy="periodic:512")

A pydantic dataclass: each field's type carries its rule (`Count`: an integer > 0, `Bytes`,
`one_of(...)`, ...), the rules between fields are `_check_policy` / `_check_parallel`. A bad value
raises ConfigError (not pydantic's ValidationError) naming the field and what it accepts:
"EngineConfig.kv_cache_bytes: must be an integer > 0, got -1". Sizes are bytes: an int, or a
string with a binary suffix ("256MiB", "8GiB"; `parse_bytes`). The serve config
(`cluster/config.py`, key `engine`) and the `kvmesh generate` flags are derived from these fields
(name, default, help in `metadata`, and for the serve config the same rules), so a setting is
added here once.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, get_args, get_origin

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, PlainValidator, Strict, ValidationError
from pydantic import model_validator
from pydantic.dataclasses import dataclass

from kvmesh.kvstore.store.mac import MIN_KEY_BYTES
from kvmesh.kvstore.store.nixl_reader import READERS as STORE_READERS
from kvmesh.kvstore.policy.planner import PolicyError, SwaPolicy
from kvmesh.kvstore.redact import redact_url
from kvmesh.kvstore.timed_io import DEFAULT_READ_TIMEOUT_S
from kvmesh.workers.model.args import ConfigError
from kvmesh.workers.spec.draft_rule import DraftRule

DTYPES = ("float32", "bfloat16", "float16")
KERNEL_BACKENDS = ("auto", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8")
INDEX_SCHEMES = ("redis://", "rediss://", "unix://")
AUTO_DRAFTS = "1:2,16:1,32:0"    # speculative_tokens=auto: measured on this CPU (docs/benchmarks.md)
DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")
BYTE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
# errors never show the input (pydantic's text): a value may be the store key or a Redis password;
# the messages below show it only where it cannot be (numbers, booleans, choices)
_CONFIG = ConfigDict(extra="forbid", hide_input_in_errors=True, validate_default=True)


def setting(default, help: str, *, choices: tuple[str, ...] | None = None, serve: bool = True,
            cli: bool = True, unit: str | None = None, repr: bool = True):
    """A field with what the serve config and the CLI need to expose it (pydantic reads `help`
    as the field's description; the field's rule is in its type).

    serve / cli: whether `cluster/config.py` / `kvmesh generate` expose it;
    choices / unit "bytes": what the CLI shows (the type checks them: `one_of`, `Bytes`)."""
    meta = {"help": help, "description": help, "choices": choices, "serve": serve, "cli": cli, "unit": unit}
    return dataclasses.field(default=default, repr=repr, metadata=meta)


def parse_bytes(value: int | str | None) -> int | None:
    """An int (bytes) or "256MiB" / "8 GiB" / "512KiB" / "1024" -> bytes; None stays None."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    unit = m.group(2).lower() if m else None
    if unit not in BYTE_UNITS:
        raise ValueError(f"{value!r} is not a size: give bytes, or a number with a binary suffix "
                         f"({', '.join(u for u in ('KiB', 'MiB', 'GiB', 'TiB'))})")
    return int(float(m.group(1)) * BYTE_UNITS[unit])


# ---- the rules a field's type carries ------------------------------------------------------------
# numbers are strict: a string or a bool is not a number (an int is a float)
Count = Annotated[int, Strict(), Field(gt=0)]                    # an integer > 0
Seconds = Annotated[float, Strict(), Field(gt=0)]                # a number > 0
SecondsOrZero = Annotated[float, Strict(), Field(ge=0)]          # a number >= 0
Bytes = Annotated[int, BeforeValidator(parse_bytes), Strict(), Field(gt=0)]    # "64MiB" or an int > 0
BytesOrZero = Annotated[int, BeforeValidator(parse_bytes), Strict(), Field(ge=0)]


def one_of(choices: tuple[str, ...]) -> AfterValidator:
    def check(value: str | None) -> str | None:
        if value is not None and value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return value
    return AfterValidator(check)


def _path_text(value: Any) -> Any:
    """A folder given as a pathlib.Path is kept as its text."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _device(value: Any) -> str:
    text = str(value)                         # a torch.device is its text
    if not DEVICE_RE.match(text):
        raise ValueError(f"{text!r} is not cpu, cuda or cuda:N")
    return text


def _index(value: str) -> str:
    if value != "local" and not value.startswith(INDEX_SCHEMES):
        raise ValueError(f"{redact_url(value)!r} is neither 'local' nor a URL starting with "
                         f"{', '.join(INDEX_SCHEMES)}")
    return value


def _store_key(value: str | None) -> str | None:
    if value is not None and len(value.encode()) < MIN_KEY_BYTES:     # never shown: its length only
        raise ValueError(f"must be at least {MIN_KEY_BYTES} bytes (e.g. `openssl rand -hex 32`), "
                         f"got {len(value.encode())}")
    return value


def _drafts(value: Any) -> int | str | None:
    if isinstance(value, str) and value.isdigit():          # "2" from a flag or an environment
        value = int(value)
    if not (value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool)
                                                 and value >= 0)):
        raise ValueError(f"must be an int >= 0 or auto, got {value!r}")
    return value


def _draft_rule(value: str) -> str:
    DraftRule.parse(value)                    # ValueError naming what it accepts
    return value


@dataclass(frozen=True, config=_CONFIG)
class EplbConfig:
    """vLLM's `--eplb-config` (JSON): `num_redundant_experts` R (physical experts beyond the
    logical ones, a multiple of the ranks: data_parallel_size x tensor_parallel_size), `window_size` (steps of load kept),
    `step_interval` (steps between rebalances). Defaults are vLLM's."""
    num_redundant_experts: Annotated[int, Strict(), Field(ge=0)] = 0
    window_size: Annotated[int, Strict(), Field(ge=1)] = 1000
    step_interval: Annotated[int, Strict(), Field(ge=1)] = 3000

    @classmethod
    def parse(cls, value: "EplbConfig | dict | str | None") -> "EplbConfig":
        """From a dict, its JSON text, or None (the defaults); ConfigError naming the key."""
        try:
            return _eplb_settings(value)
        except ValidationError as e:
            raise config_error(e, "EngineConfig.eplb_config", cls.__pydantic_fields__) from None
        except ValueError as e:
            raise ConfigError(f"EngineConfig.eplb_config: {e}") from None


def _eplb_settings(value: Any) -> EplbConfig:
    """EngineConfig.eplb_config's validator: an EplbConfig, a dict, its JSON text, or None."""
    if isinstance(value, EplbConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e}): {value!r}") from None
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise ValueError(f"expected an object, got {value!r}")
    return EplbConfig.__pydantic_validator__.validate_python(value)   # errors located under eplb_config


@dataclass(frozen=True, config=_CONFIG)
class EngineConfig:
    model: Annotated[str | None, BeforeValidator(_path_text)] = setting(
        None, "checkpoint directory (default: the built-in tiny V4 model)")
    dtype: Annotated[str | None, one_of(DTYPES)] = setting(None, "compute dtype (default: the checkpoint's)",
                                                           choices=DTYPES)
    device: Annotated[str, PlainValidator(_device)] = setting("cpu", "torch device: cpu, cuda or cuda:N")
    block_tokens: Count = setting(128, "tokens per classical-cache block (a multiple of lcm of the compress ratios)")
    kv_cache_bytes: Bytes = setting(256 << 20, "memory for classical blocks + state slots, split automatically",
                                    unit="bytes")
    max_num_seqs: Count = setting(64, "most requests in the running batch")
    max_batched_tokens: Count = setting(1024, "most tokens per step (chunked prefill)")
    max_model_len: Count | None = setting(None, "longest prompt + output (default: the model's "
                                                "max_position_embeddings, capped by the KV budget)")
    kernel_backend: Annotated[str, one_of(KERNEL_BACKENDS)] = setting(
        "auto", "kernels: torch, triton (auto: Triton on CUDA)", choices=KERNEL_BACKENDS)
    store: Annotated[str | None, BeforeValidator(_path_text)] = setting(
        None, "shared store for prefix reuse: a folder / mount or a pyarrow.fs URI (file://, s3://...); "
              "none = memory only")
    store_capacity_bytes: Bytes | None = setting(None, "store capacity; LRU-evicted beyond it (default: unbounded)",
                                                 unit="bytes")
    index: Annotated[str, AfterValidator(_index)] = setting(
        "local", "prefix index: local (embedded) or redis://host:port/db (rediss://, unix://)")
    swa_policy: str = setting("full", "what SWA state is persisted: full | periodic:P | zero | auto | auto:P "
                                      "(P a multiple of block_tokens)")
    kv_cache_dtype: Annotated[str, one_of(KV_CACHE_DTYPES)] = setting(
        "auto", "compressed entries + indexer keys: auto (= the compute dtype), bfloat16, or fp8 (V4's FP8 "
                "records)", choices=KV_CACHE_DTYPES)
    host_cache_bytes: BytesOrZero = setting(256 << 20, "host-memory tier of restored / persisted objects",
                                            unit="bytes")
    worker_id: str | None = setting(None, "name in the index's memory tier (default host:pid)", serve=False,
                                    cli=False)
    prefix_reuse: bool = setting(True, "restore and persist prefixes (false: never; baselines)")
    restore_prefetch_bytes: BytesOrZero = setting(
        512 << 20, "prefetch: store objects a queued request's hit needs are read off the engine step into "
                   "host memory of at most this many bytes, before it is scheduled; 0 = read in the step", unit="bytes")
    restore_wait_s: Seconds = setting(2.0, "prefetch: a request waits at most this long for its reads, plus "
                                         "restore_wait_s_per_1k_tokens; then it runs with what arrived "
                                         "(the rest recomputed)")
    restore_wait_s_per_1k_tokens: SecondsOrZero = setting(0.05, "prefetch: the wait's share per 1,000 prompt tokens")
    speculative_tokens: Annotated[int | str | None, PlainValidator(_drafts)] = setting(
        None, "drafts per decode step from the checkpoint's MTP layer: K, or auto (by the batch: "
              "speculative_auto); 0 = off; default: auto when the checkpoint has mtp.* weights, else 0")
    speculative_auto: Annotated[str, AfterValidator(_draft_rule)] = setting(
        AUTO_DRAFTS, "speculative_tokens=auto: drafts per step by the number of sequences in the step, as "
                     "batch:k pairs (1:2,16:1,32:0: k = 2 up to batch 15, 1 up to 31, none from 32)")
    store_key: Annotated[str | None, AfterValidator(_store_key)] = setting(
        None, "MAC key (>= 16 bytes) for store objects; default: $KVMESH_STORE_KEY", cli=False, repr=False)
    require_store: bool = setting(False, "a store / index unusable at start-up is fatal (default: run "
                                         "without prefix reuse)")
    store_read_timeout_s: Seconds | None = setting(DEFAULT_READ_TIMEOUT_S, "a store read slower than this (s) "
                                                                           "is a miss")
    store_reader: Annotated[str, one_of(STORE_READERS)] = setting(
        "auto", "how a restore reads block objects from a local-folder store: nixl (NIXL's POSIX backend "
                "into registered memory), file (this process's reads), auto (nixl where it loads); a store "
                "elsewhere is read through pyarrow.fs", choices=STORE_READERS)
    store_reads_in_flight: Count = setting(
        4, "store reads a restore may have in flight at once: once a prefetch's first objects read slowly (a "
           "network mount, an object store), it reads the rest in this many parts side by side")
    handoff_loads_in_flight: Annotated[int, Strict(), Field(ge=0)] = setting(
        4, "caches written into requests' blocks at once off the engine step (each request waits with its "
           "blocks and slot reserved while the step runs the others): handed-off caches (decode role) and "
           "prefix hits from host memory or the store admitted while others run; 0: inside the step")
    store_scrub_interval_s: Annotated[float, Strict(), Field(ge=0)] = setting(
        600.0, "seconds between background scrub passes over this deployment's store namespace "
               "(kvstore/store/scrub.py; 0 = off)")
    store_scrub_pass_bytes: Bytes = setting(1 << 30, "object bytes one background scrub pass reads at most (the "
                                                     "next resumes where it stopped)", unit="bytes")
    max_schema_bytes: Bytes = setting(64 << 10, "largest response_format JSON schema (canonical JSON); larger is "
                                                "a 400 before any work", unit="bytes")
    grammar_compile_timeout_s: Seconds = setting(10.0, "a response_format schema whose compile takes longer (s) "
                                                       "is stopped and the request gets a 400")
    grammar_compile_memory_bytes: Bytes = setting(2 << 30, "memory each schema compiler process may use (it "
                                                           "starts at ~300 MiB); beyond it the compile is "
                                                           "stopped, a 400", unit="bytes")
    grammar_compile_workers: Count | None = setting(None, "schema compiler processes per engine (each compiles "
                                                          "one grammar at a time, within the budgets above); one "
                                                          "is kept for small schemas while large ones compile "
                                                          "(default: the CPUs, at most 4)")
    tensor_parallel_size: Count = setting(1, "ranks one replica (or, with data_parallel_size, one DP "
                                             "rank) spans (vLLM's name): heads, output groups, vocabulary and "
                                             "experts split across them; every rank holds the whole cache", serve=False)   # serve: per pool (it sizes the placement group)
    data_parallel_size: Count = setting(1, "data-parallel attention (vLLM's name): N whole attention engines "
                                           "(own scheduler, KV cache, prefix cache) in lockstep, routed experts "
                                           "split across them (needs enable_expert_parallel); with "
                                           "tensor_parallel_size T each DP rank is a group of T ranks, the "
                                           "experts split over all N x T", serve=False)
    data_parallel_size_local: Count | None = setting(
        None, "data-parallel ranks per node (vLLM's name; default: data_parallel_size, one node): a replica "
              "of data_parallel_size ranks spans data_parallel_size / data_parallel_size_local nodes (Serve "
              "places them; EPLB's placement is then hierarchical)", serve=False, cli=False)
    enable_expert_parallel: bool = setting(False, "each rank owns n_routed_experts/N whole experts (N: "
                                                  "tensor_parallel_size, else every expert's intermediate dim "
                                                  "is split; or data_parallel_size, where it is required)",
                                           serve=False)
    enable_eplb: bool = setting(False, "expert-parallel load balancing (vLLM's name; data_parallel_size > 1): "
                                       "replicate the hottest experts and re-place them by counted load "
                                       "(DeepSeek's EPLB); outputs unchanged", serve=False)   # serve: per pool
    eplb_config: Annotated[EplbConfig | dict | str | None, PlainValidator(_eplb_settings)] = setting(
        None, "EPLB as JSON (vLLM's keys): {\"num_redundant_experts\": R, \"window_size\": W, "
              "\"step_interval\": S}; R a multiple of data_parallel_size (x tensor_parallel_size) "
              "(default: 0, 1000, 3000)", serve=False)
    rank_timeout_s: Seconds = setting(60.0, "tensor parallelism: a collective slower than this (s) means a rank "
                                            "died or stalled (RankFailed)")
    cuda_graphs: bool = setting(False, "on CUDA, decode steps replay graphs captured per batch-size bucket; off by "
                                       "default until tests/gpu/test_cuda_graphs.py has run on a GPU "
                                       "(ignored on the CPU)")

    @model_validator(mode="after")
    def _check_policy(self) -> "EngineConfig":
        try:
            SwaPolicy.parse(self.swa_policy, self.block_tokens)
        except PolicyError as e:
            raise ConfigError(f"EngineConfig.swa_policy: {e}") from None
        return self

    @model_validator(mode="after")
    def _check_parallel(self) -> "EngineConfig":
        """What data-parallel attention is built for (the model-dependent sizes are checked at
        start-up, workers/engine/data_parallel.py)."""
        dp, eplb = self.data_parallel_size, self.eplb_config
        ranks = dp * self.tensor_parallel_size           # the ranks the routed experts are split over
        if self.enable_eplb and dp == 1:
            raise ConfigError("EngineConfig.enable_eplb: needs data_parallel_size > 1 with enable_expert_parallel "
                              "(the experts it balances are split across data-parallel ranks)")
        if self.enable_eplb and eplb.num_redundant_experts % ranks:
            across = (f"data_parallel_size={dp}" if ranks == dp else
                      f"data_parallel_size x tensor_parallel_size = {dp} x {self.tensor_parallel_size} = {ranks}")
            raise ConfigError(f"EngineConfig.eplb_config.num_redundant_experts={eplb.num_redundant_experts} is not a "
                              f"multiple of {across} (each rank holds the same number of experts)")
        local = self.data_parallel_size_local
        if local is not None and dp % local:
            raise ConfigError(f"EngineConfig.data_parallel_size_local={local!r} must be an integer >= 1 that "
                              f"divides data_parallel_size={dp} (every node of a replica holds the same number "
                              "of ranks)")
        if dp == 1:
            return self
        if not self.enable_expert_parallel:
            raise ConfigError(f"EngineConfig.data_parallel_size={dp} needs enable_expert_parallel=true "
                              f"(--enable-expert-parallel): the routed experts are split across the {dp} ranks; "
                              f"for {dp} independent copies of the model run {dp} replicas instead")
        return self

    def draft_rule(self, has_mtp: bool) -> DraftRule | None:
        """Drafts per step as this config asks (None: off): K, auto, or by default auto when the
        checkpoint has an MTP layer."""
        k = self.speculative_tokens
        if k == "auto" or (k is None and has_mtp):
            return DraftRule.parse(self.speculative_auto)
        return DraftRule.fixed(k) if k else None

    @property
    def policy(self) -> SwaPolicy:
        return SwaPolicy.parse(self.swa_policy, self.block_tokens)

    def __repr__(self) -> str:    # the index URL may carry a password; the store key is never shown
        fields = (f"{f.name}={redact_url(repr(getattr(self, f.name)))}" for f in dataclasses.fields(self)
                  if f.repr)
        return f"EngineConfig({', '.join(fields)})"


# ---- pydantic's ValidationError -> ConfigError naming the field and the rule ---------------------
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
_NOT_A_NUMBER = ("int_type", "int_parsing", "int_from_float", "float_type", "float_parsing", "finite_number")


def _kinds(annotation) -> tuple:
    """The types an annotation allows: `Count | None` -> (int, NoneType)."""
    kinds = get_args(annotation) if get_origin(annotation) is not Annotated else (annotation,)
    return tuple(get_args(k)[0] if get_origin(k) is Annotated else k for k in kinds or (annotation,))


def _field(fields: Mapping[str, Any], loc: tuple[str, ...]):
    """The FieldInfo at `loc` (through nested pydantic dataclasses), and the fields beside it."""
    for name in loc[:-1]:
        info = fields.get(name)
        inner = [k for k in _kinds(info.annotation) if hasattr(k, "__pydantic_fields__")] if info else []
        fields = inner[0].__pydantic_fields__ if inner else {}
    return (fields.get(loc[-1]) if loc else None), fields


def _is_int(info) -> bool:
    kinds = _kinds(info.annotation) if info is not None else ()
    return int in kinds and float not in kinds


def _rule(err: dict, info) -> str:
    """What the value broke, in words; the input only where it is a number, a bool or None."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return str(ctx["error"])
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
        return f"must be {'an integer' if _is_int(info) else 'a number'} {_BOUNDS[kind]} {bound}, got {value!r}"
    if kind in _NOT_A_NUMBER:
        exact = isinstance(value, float) and _is_int(info)
        return f"must be {'an integer' if exact else 'a number'}, got {value!r}"
    if kind.startswith("bool_"):
        return f"must be true or false, got {value!r}" if isinstance(value, (bool, int, float)) else \
            "must be true or false"
    if kind == "string_type":
        return f"must be a string, got {type(value).__name__}"
    return err["msg"]


def config_error(e: ValidationError, owner: str, fields: Mapping[str, Any]) -> ConfigError:
    """One ConfigError for all of `e`'s errors: "owner.field: rule"; keys not among `fields` (or
    a nested dataclass's) are listed with the ones there are. A rule between fields (no field in
    its location) names its fields itself."""
    lines, unknown = [], {}
    for err in e.errors(include_url=False):
        loc = tuple(str(p) for p in err["loc"])
        if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            unknown.setdefault(loc[:-1], []).append(loc[-1])
            continue
        info, _ = _field(fields, loc)
        text = _rule(err, info)
        lines.append(f"{'.'.join((owner, *loc))}: {text}" if loc else text)
    for parent, names in unknown.items():
        _, known = _field(fields, (*parent, ""))
        lines.append(f"{'.'.join((owner, *parent))}: unknown key(s) {', '.join(sorted(names))}; "
                     f"expected {', '.join(known)}")
    return ConfigError("; ".join(dict.fromkeys(lines)))


def _raises_config_error(cls: type, owner: str) -> type:
    """Building `cls` (directly, or by dataclasses.replace) raises ConfigError, not pydantic's
    ValidationError."""
    validate = cls.__init__

    @functools.wraps(validate)
    def __init__(self, *args, **kwargs):
        try:
            validate(self, *args, **kwargs)
        except ValidationError as e:
            raise config_error(e, owner, cls.__pydantic_fields__) from None

    cls.__init__ = __init__
    return cls


_raises_config_error(EplbConfig, "EngineConfig.eplb_config")
_raises_config_error(EngineConfig, "EngineConfig")
