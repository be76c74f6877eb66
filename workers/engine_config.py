"""EngineConfig: every engine setting, its default, its help and its check, in one place.

    EngineConfig(model=DIR, kv_cache_bytes="64MiB", swa_policy="periodic:512")

Sizes are bytes: an int, or a string with a binary suffix ("256MiB", "8GiB"; `parse_bytes`).
The serve config (`cluster/config.py`, key `engine`) and the `kvmesh generate` flags are
derived from these fields (name, default, help in `metadata`), so a setting is added here
once. A bad value raises ConfigError naming the field and what it accepts.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

from kvmesh.kvstore.store.mac import MIN_KEY_BYTES
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


def setting(default, help: str, *, choices: tuple[str, ...] | None = None, serve: bool = True,
            cli: bool = True, unit: str | None = None, repr: bool = True):
    """A field with what the serve config and the CLI need to expose it.

    serve / cli: whether `cluster/config.py` / `kvmesh generate` expose it;
    unit "bytes": the value may be written with a suffix (`parse_bytes`)."""
    meta = {"help": help, "choices": choices, "serve": serve, "cli": cli, "unit": unit}
    return field(default=default, repr=repr, metadata=meta)


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


@dataclass(frozen=True)
class EplbConfig:
    """vLLM's `--eplb-config` (JSON): `num_redundant_experts` R (physical experts beyond the
    logical ones, a multiple of data_parallel_size), `window_size` (steps of load kept),
    `step_interval` (steps between rebalances). Defaults are vLLM's."""
    num_redundant_experts: int = 0
    window_size: int = 1000
    step_interval: int = 3000

    @classmethod
    def parse(cls, value: "EplbConfig | dict | str | None") -> "EplbConfig":
        """From a dict, its JSON text, or None (the defaults); ConfigError naming the key."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"EngineConfig.eplb_config: not JSON ({e}): {value!r}") from None
        value = {} if value is None else value
        if not isinstance(value, dict):
            raise ConfigError(f"EngineConfig.eplb_config: expected an object, got {value!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ConfigError(f"EngineConfig.eplb_config: unknown key(s) {', '.join(unknown)}; "
                              f"expected {', '.join(names)}")
        for name, v in value.items():
            least = 0 if name == "num_redundant_experts" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ConfigError(f"EngineConfig.eplb_config.{name}: must be an integer >= {least}, got {v!r}")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = setting(None, "checkpoint directory (default: the built-in tiny V4 model)")
    dtype: str | None = setting(None, "compute dtype (default: the checkpoint's)", choices=DTYPES)
    device: str = setting("cpu", "torch device: cpu, cuda or cuda:N")
    block_tokens: int = setting(128, "tokens per classical-cache block (a multiple of lcm of the compress ratios)")
    kv_cache_bytes: int = setting(256 << 20, "memory for classical blocks + state slots, split automatically",
                                  unit="bytes")
    max_num_seqs: int = setting(64, "most requests in the running batch")
    max_batched_tokens: int = setting(1024, "most tokens per step (chunked prefill)")
    max_model_len: int | None = setting(None, "longest prompt + output (default: the model's "
                                              "max_position_embeddings, capped by the KV budget)")
    kernel_backend: str = setting("auto", "kernels: torch, triton (auto: Triton on CUDA)", choices=KERNEL_BACKENDS)
    store: str | None = setting(None, "shared store for prefix reuse: a folder / mount or a pyarrow.fs URI "
                                      "(file://, s3://...); none = memory only")
    store_capacity_bytes: int | None = setting(None, "store capacity; LRU-evicted beyond it (default: unbounded)",
                                               unit="bytes")
    index: str = setting("local", "prefix index: local (embedded) or redis://host:port/db (rediss://, unix://)")
    swa_policy: str = setting("full", "what SWA state is persisted: full | periodic:P | zero | auto | auto:P "
                                      "(P a multiple of block_tokens)")
    kv_cache_dtype: str = setting("auto", "compressed entries + indexer keys: auto (= the compute dtype), "
                                          "bfloat16, or fp8 (V4's FP8 records)", choices=KV_CACHE_DTYPES)
    host_cache_bytes: int = setting(256 << 20, "host-memory tier of restored / persisted objects", unit="bytes")
    worker_id: str | None = setting(None, "name in the index's memory tier (default host:pid)", serve=False,
                                    cli=False)
    prefix_reuse: bool = setting(True, "restore and persist prefixes (false: never; baselines)")
    speculative_tokens: int | str | None = setting(None, "drafts per decode step from the checkpoint's MTP layer: "
                                                         "K, or auto (by the batch: speculative_auto); 0 = off; "
                                                         "default: auto when the checkpoint has mtp.* weights, else 0")
    speculative_auto: str = setting(AUTO_DRAFTS, "speculative_tokens=auto: drafts per step by the number of "
                                                 "sequences in the step, as batch:k pairs (1:2,16:1,32:0: k = 2 "
                                                 "up to batch 15, 1 up to 31, none from 32)")
    store_key: str | None = setting(None, "MAC key (>= 16 bytes) for store objects; default: $KVMESH_STORE_KEY",
                                    cli=False, repr=False)
    require_store: bool = setting(False, "a store / index unusable at start-up is fatal (default: run "
                                         "without prefix reuse)")
    store_read_timeout_s: float | None = setting(DEFAULT_READ_TIMEOUT_S, "a store read slower than this (s) "
                                                                         "is a miss")
    store_scrub_interval_s: float = setting(600.0, "seconds between background scrub passes over this "
                                                   "deployment's store namespace (kvstore/store/scrub.py; 0 = off)")
    store_scrub_pass_bytes: int = setting(1 << 30, "object bytes one background scrub pass reads at most (the next "
                                                   "resumes where it stopped)", unit="bytes")
    max_schema_bytes: int = setting(64 << 10, "largest response_format JSON schema (canonical JSON); larger is a "
                                              "400 before any work", unit="bytes")
    grammar_compile_timeout_s: float = setting(10.0, "a response_format schema whose compile takes longer (s) is "
                                                     "stopped and the request gets a 400")
    grammar_compile_memory_bytes: int = setting(2 << 30, "memory each schema compiler process may use (it starts at "
                                                         "~300 MiB); beyond it the compile is stopped, a 400",
                                                unit="bytes")
    grammar_compile_workers: int | None = setting(None, "schema compiler processes per engine (each compiles one "
                                                        "grammar at a time, within the budgets above); one is kept "
                                                        "for small schemas while large ones compile (default: the "
                                                        "CPUs, at most 4)")
    tensor_parallel_size: int = setting(1, "ranks one replica spans (vLLM's name): heads, output groups, vocabulary "
                                           "and experts split across them; every rank holds the whole cache",
                                        serve=False)   # serve: per pool (it sizes the placement group)
    data_parallel_size: int = setting(1, "data-parallel attention (vLLM's name): N whole attention engines (own "
                                         "scheduler, KV cache, prefix cache) in lockstep, routed experts split "
                                         "across them (needs enable_expert_parallel)", serve=False)
    data_parallel_size_local: int | None = setting(
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
    eplb_config: EplbConfig | dict | str | None = setting(
        None, "EPLB as JSON (vLLM's keys): {\"num_redundant_experts\": R, \"window_size\": W, "
              "\"step_interval\": S}; R a multiple of data_parallel_size (default: 0, 1000, 3000)", serve=False)
    rank_timeout_s: float = setting(60.0, "tensor parallelism: a collective slower than this (s) means a rank "
                                          "died or stalled (RankFailed)")
    cuda_graphs: bool = setting(False, "on CUDA, decode steps replay graphs captured per batch-size bucket; off by default "
                                       "until tests/gpu/test_cuda_graphs.py has run on a GPU "
                                      "(ignored on the CPU)")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.metadata.get("unit") == "bytes":
                try:
                    object.__setattr__(self, f.name, parse_bytes(getattr(self, f.name)))
                except ValueError as e:
                    raise ConfigError(f"EngineConfig.{f.name}: {e}") from None
        for check in (self._check_choices, self._check_sizes, self._check_places, self._check_parallel,
                      self._check_drafts):
            check()

    def _check_choices(self) -> None:
        for f in dataclasses.fields(self):
            value, choices = getattr(self, f.name), f.metadata.get("choices")
            if choices and value is not None and value not in choices:
                raise ConfigError(f"EngineConfig.{f.name}: {value!r} is not one of {', '.join(choices)}")
        try:
            SwaPolicy.parse(self.swa_policy, self.block_tokens)
        except PolicyError as e:
            raise ConfigError(f"EngineConfig.swa_policy: {e}") from None

    def _check_sizes(self) -> None:
        positive = ("block_tokens", "kv_cache_bytes", "max_num_seqs", "max_batched_tokens", "max_model_len",
                    "store_capacity_bytes", "store_read_timeout_s", "store_scrub_pass_bytes", "tensor_parallel_size", "data_parallel_size",
                    "rank_timeout_s",
                    "max_schema_bytes", "grammar_compile_timeout_s", "grammar_compile_memory_bytes",
                    "grammar_compile_workers")
        for name in positive:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise ConfigError(f"EngineConfig.{name}: must be a number, got {value!r}")
            if value is not None and not value > 0:
                raise ConfigError(f"EngineConfig.{name}: must be > 0, got {value!r}")
        for name in ("host_cache_bytes", "store_scrub_interval_s"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"EngineConfig.{name}: must be >= 0, got {getattr(self, name)!r}")

    def _check_places(self) -> None:
        if not DEVICE_RE.match(str(self.device)):
            raise ConfigError(f"EngineConfig.device: {self.device!r} is not cpu, cuda or cuda:N")
        if self.store_key is not None and len(self.store_key.encode()) < MIN_KEY_BYTES:
            raise ConfigError(f"EngineConfig.store_key: must be at least {MIN_KEY_BYTES} bytes "
                              f"(e.g. `openssl rand -hex 32`), got {len(self.store_key.encode())}")
        if self.index != "local" and not str(self.index).startswith(INDEX_SCHEMES):
            raise ConfigError(f"EngineConfig.index: {redact_url(self.index)!r} is neither 'local' nor a URL "
                              f"starting with {', '.join(INDEX_SCHEMES)}")

    def _check_parallel(self) -> None:
        """What data-parallel attention is built for (the model-dependent sizes are checked at
        start-up, workers/engine/data_parallel.py)."""
        dp = self.data_parallel_size
        object.__setattr__(self, "eplb_config", eplb := EplbConfig.parse(self.eplb_config))
        if self.enable_eplb and dp == 1:
            raise ConfigError("EngineConfig.enable_eplb: needs data_parallel_size > 1 with enable_expert_parallel "
                              "(the experts it balances are split across data-parallel ranks)")
        if self.enable_eplb and eplb.num_redundant_experts % dp:
            raise ConfigError(f"EngineConfig.eplb_config.num_redundant_experts={eplb.num_redundant_experts} is not a "
                              f"multiple of data_parallel_size={dp} (each rank holds the same number of experts)")
        local = self.data_parallel_size_local
        if local is not None and (isinstance(local, bool) or not isinstance(local, int) or local < 1 or dp % local):
            raise ConfigError(f"EngineConfig.data_parallel_size_local={local!r} must be an integer >= 1 that "
                              f"divides data_parallel_size={dp} (every node of a replica holds the same number "
                              "of ranks)")
        if dp == 1:
            return
        if not self.enable_expert_parallel:
            raise ConfigError(f"EngineConfig.data_parallel_size={dp} needs enable_expert_parallel=true "
                              f"(--enable-expert-parallel): the routed experts are split across the {dp} ranks; "
                              f"for {dp} independent copies of the model run {dp} replicas instead")
        if self.tensor_parallel_size > 1:
            raise ConfigError(f"EngineConfig: tensor_parallel_size={self.tensor_parallel_size} with "
                              f"data_parallel_size={dp} (attention TP inside a DP rank) is not built yet; "
                              f"use one of them")

    def _check_drafts(self) -> None:
        k = self.speculative_tokens
        if isinstance(k, str) and k.isdigit():          # "2" from a flag or an environment
            object.__setattr__(self, "speculative_tokens", k := int(k))
        if not (k is None or k == "auto" or (isinstance(k, int) and not isinstance(k, bool) and k >= 0)):
            raise ConfigError(f"EngineConfig.speculative_tokens: must be an int >= 0 or auto, got {k!r}")
        try:
            DraftRule.parse(self.speculative_auto)
        except ValueError as e:
            raise ConfigError(f"EngineConfig.speculative_auto: {e}") from None

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
