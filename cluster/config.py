"""The serving config: one typed tree, validated once, loaded from YAML.

    mode: disaggregated | colocated
    engine:    what every worker runs: workers.engine_config.EngineConfig's fields
    prefill / decode / colocated:  one pool each (replicas or autoscaling, resources, parallel
               sizes — tensor_parallel_size or data_parallel_size (+ data_parallel_size_local),
               enable_expert_parallel, enable_eplb + eplb_config — `engine` overrides for that pool)
    ingress:   the OpenAI front end
    handoff:   prefill -> decode transport (nixl, or ray objects)

`load_config(path)` reads either this tree directly or a Serve config file
(`applications[0].args`), so `kvmesh serve --config deploy/serve.yaml` and
`serve run deploy/serve.yaml` agree on one file.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from kvmesh.workers.engine_config import EngineConfig, config_error, parse_bytes
from kvmesh.workers.model.args import ConfigError

MiB = 1 << 20
HEAD_IP = "{head_ip}"
STORE_KEY_ENV = "KVMESH_STORE_KEY"
REDIS_PASSWORD = "{redis_password}"
REDIS_PASSWORD_ENV = "KVMESH_REDIS_PASSWORD"


class ConfigFileError(ValueError):
    """The config file is missing, not YAML, or does not validate; the message says where."""


class _Strict(BaseModel):
    # errors name the key and the problem, never the input (it may hold the store key or a Redis password)
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


SERVE_STORE = str(Path("~/.cache/kvmesh/store").expanduser())   # a server keeps its prefixes across restarts
RENAMED = {"kv_cache_mb": "kv_cache_bytes", "store_capacity_mb": "store_capacity_bytes",
           "host_cache_mb": "host_cache_bytes"}


def _engine_fields(overrides: bool) -> dict[str, Any]:
    """EngineConfig's serve fields as pydantic model fields, taken from EngineConfig's own
    (`__pydantic_fields__`): the same names, help, defaults and per-field rules (types with their
    constraints and validators). `overrides` (a pool's `engine` key): no default and no rule here;
    a pool's overrides are checked once merged into its engine (`ServeConfig.pool_engine`), by the
    same rules, so they fail with the same messages."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        if not f.metadata.get("serve", True):
            continue
        info = EngineConfig.__pydantic_fields__[f.name]
        kind = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        if f.name == "store_key":           # a secret here; its length is checked by EngineConfig
            kind = SecretStr | None
        elif overrides:
            kind = Any
        default = None if overrides else SERVE_STORE if f.name == "store" else f.default
        out[f.name] = (kind, Field(default, description=info.description))
    return out


# EngineConfig's fields a pool sets (they size its placement group), not its `engine` key
POOL_ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(EngineConfig)
                         if not f.metadata.get("serve", True) and f.name != "worker_id")


def _no_renamed_keys(data, where: str):
    if isinstance(data, dict):
        for old, new in RENAMED.items():
            if old in data:
                raise ValueError(f"{where}{old} is now {where}{new}: sizes are bytes, written as a number or "
                                 f"with a suffix ({new}: {data[old]}MiB)")
        for key in POOL_ENGINE_KEYS:
            if key in data:
                raise ValueError(f"{where}{key} is a pool's key, not an engine setting: prefill.{key}, "
                                 f"decode.{key} or colocated.{key}")
    return data


def _engine_message(e: ValidationError) -> str:
    """`e` (an EngineSettings error) as EngineConfig words it: "EngineConfig.field: rule"."""
    return str(config_error(e, "EngineConfig", EngineSettings.model_fields))


# create_model, not `engine: EngineConfig`: the serve keys need a BaseModel (model_fields_set for a
# pool's overrides, model_copy, model_dump) and differ from EngineConfig's fields (no worker_id or
# parallel sizes, store_key a secret, store's default); the fields are EngineConfig's own
# FieldInfos, so nothing here is a hand-kept copy of a type, a default or a rule.
class EngineSettings(create_model("_EngineFields", __base__=_Strict, **_engine_fields(False))):
    """The `engine` key: EngineConfig's fields (workers/engine_config.py), checked by its rules,
    errors worded as EngineConfig's ("EngineConfig.kv_cache_bytes: ..."). Serve-only differences:
    `store` defaults to ~/.cache/kvmesh/store, `store_key` is a secret (default: $KVMESH_STORE_KEY
    of each worker), `worker_id` is each replica's id."""

    @model_validator(mode="wrap")
    @classmethod
    def _worded_as_engine_config(cls, data, handler):
        try:
            return handler(data)
        except ValidationError as e:
            raise ValueError(_engine_message(e)) from None

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        return _no_renamed_keys(data, "")

    @field_validator("store")
    @classmethod
    def _expand_home(cls, v):
        return str(Path(v).expanduser()) if v and "://" not in v else v

    @model_validator(mode="after")
    def _valid_engine_config(self):     # the rules between fields (swa_policy and block_tokens, ...)
        self.engine_config()
        return self

    def engine_config(self, worker_id: str | None = None) -> EngineConfig:
        key = self.store_key.get_secret_value() if self.store_key else os.environ.get(STORE_KEY_ENV) or None
        values = {name: getattr(self, name) for name in type(self).model_fields if name != "store_key"}
        return EngineConfig(**values, store_key=key, worker_id=worker_id)


class EngineOverrides(create_model("_EngineOverrideFields", __base__=_Strict, **_engine_fields(True))):
    """A pool's `engine` key: the engine settings this pool changes (only those given count),
    checked merged into the pool's engine (`ServeConfig._valid_pool_engines`)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        return _no_renamed_keys(data, "engine.")

    @model_serializer(mode="wrap")
    def _only_given(self, handler):     # a dumped config reloads with the same overrides, no more
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


class Autoscaling(_Strict):
    """Ray Serve's autoscaling_config (the subset kvmesh exposes)."""
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(2.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    look_back_period_s: float = Field(10.0, gt=0)
    metrics_interval_s: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _ordered(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class PoolConfig(_Strict):
    num_replicas: int = Field(1, ge=1, description="fixed size; ignored when autoscaling is set")
    autoscaling: Autoscaling | None = None
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict,
                                        description="custom node resources that pin the pool to a node type")
    max_ongoing_requests: int = Field(32, ge=1, description=(
        "serving slots per replica: requests in its engine; a request waiting for its grammar's compile "
        "holds none (max_grammar_waiting)"))
    max_queued_requests: int = Field(128, ge=-1, description="beyond this the API answers 503; -1 = no limit")
    max_grammar_waiting: int = Field(32, ge=0, description=(
        "guided requests per replica that may wait for their grammar's compile beside the serving slots "
        "(cluster/serve/grammar_gate.py); past it a 429 with Retry-After"))
    grammar_waiting_per_client: int = Field(4, ge=1, description=(
        "of those, per client (its API key, else its address); past it a 429 with Retry-After"))
    engine: EngineOverrides = Field(default_factory=EngineOverrides,
                                    description="engine settings for this pool only (e.g. kv_cache_bytes)")
    tensor_parallel_size: int = Field(1, ge=1, description=(
        "devices per replica: the replica plus N-1 rank actors, each with num_cpus / num_gpus / resources, "
        "packed on one node (one placement group per replica)"))
    data_parallel_size: int = Field(1, ge=1, description=(
        "data-parallel attention ranks per replica: N whole attention engines (the replica plus N-1 rank "
        "actors, one bundle each, packed on one node), routed experts split across them; needs "
        "enable_expert_parallel; any pool (prefill and decode hand off rank to rank). With "
        "tensor_parallel_size T each DP rank is a TP group of T processes on one node (the actor and its "
        "T-1 local processes; its bundle holds T ranks' resources), the experts split over all N x T"))
    data_parallel_size_local: int | None = Field(None, ge=1, description=(
        "data-parallel ranks per node (vLLM's name): divides data_parallel_size; a replica spans "
        "data_parallel_size / data_parallel_size_local nodes (default: all on one node): one placement "
        "group with a bundle per node (the node's ranks), STRICT_SPREAD"))
    enable_expert_parallel: bool = Field(False, description="split the routed experts whole across the ranks")
    enable_eplb: bool = Field(False, description=(
        "expert-parallel load balancing over the pool's data-parallel ranks: the hottest experts replicated "
        "and re-placed by counted load (DeepSeek's EPLB); needs data_parallel_size > 1"))
    eplb_config: dict[str, int] | None = Field(None, description=(
        "EPLB settings (vLLM's keys): num_redundant_experts (a multiple of data_parallel_size x "
        "tensor_parallel_size), window_size, "
        "step_interval; default 0, 1000, 3000"))

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        if isinstance(data, dict) and "kv_cache_mb" in data:
            raise ValueError(f"kv_cache_mb is now engine.kv_cache_bytes (engine: {{kv_cache_bytes: "
                             f"{data['kv_cache_mb']}MiB}})")
        return data

    @model_validator(mode="after")
    def _rank_bundles(self):
        if self.ranks > 1 and not self.rank_bundle():
            key = "tensor_parallel_size" if self.tensor_parallel_size > 1 else "data_parallel_size"
            raise ValueError(f"{key} {getattr(self, key)} places one rank per bundle: "
                             "give the pool num_cpus, num_gpus or resources > 0 so a bundle is not empty")
        return self

    @model_validator(mode="after")
    def _ranks_per_node(self):
        local, dp = self.data_parallel_size_local, self.data_parallel_size
        if local is None:
            return self
        if dp % local:
            raise ValueError(f"data_parallel_size_local {local} does not divide data_parallel_size {dp} "
                             "(every node of a replica holds the same number of ranks)")
        return self

    @property
    def nodes(self) -> int:
        """Nodes one replica spans: data_parallel_size / data_parallel_size_local."""
        return self.data_parallel_size // (self.data_parallel_size_local or self.data_parallel_size)

    @property
    def ranks(self) -> int:
        """Processes per replica: tensor_parallel_size x data_parallel_size."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def actors(self) -> int:
        """Ray actors per replica (the replica and its rank actors): a rank each, but one per DP
        rank when a TP group runs inside each (its TP ranks are that actor's local processes)."""
        return self.data_parallel_size if self.data_parallel_size > 1 else self.tensor_parallel_size

    @property
    def group(self) -> int:
        """Ranks each actor holds the resources of: the TP group inside a DP rank, else 1."""
        return self.ranks // self.actors

    def rank_bundle(self) -> dict[str, float]:
        """What one actor (the replica itself for rank 0) reserves in the replica's placement group:
        one rank's resources, times the TP group's size when the actor leads one inside a DP rank
        (its processes share the actor's GPUs)."""
        bundle = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: v * self.group for k, v in bundle.items() if v > 0}

    @property
    def ranks_per_bundle(self) -> int:
        """Ranks in each bundle of the replica's placement group: 1 on one node; over several,
        a bundle per node holds that node's data_parallel_size_local ranks (rank r in bundle
        r // ranks_per_bundle; the replica itself, rank 0, in bundle 0)."""
        return self.data_parallel_size_local if self.nodes > 1 else 1

    def placement(self) -> tuple[list[dict[str, float]], str]:
        """The replica's placement group (bundles, strategy): a bundle per rank packed on one
        node, or a bundle per node (its ranks' resources summed) on distinct nodes."""
        if self.nodes == 1:
            return [self.rank_bundle() for _ in range(self.actors)], "STRICT_PACK"
        per = self.ranks_per_bundle
        return [{k: v * per for k, v in self.rank_bundle().items()} for _ in range(self.nodes)], "STRICT_SPREAD"

    @property
    def serve_max_ongoing_requests(self) -> int:
        """Serve's limit for a replica: its serving slots and the requests waiting for a grammar."""
        return self.max_ongoing_requests + self.max_grammar_waiting

    def deployment_options(self, name: str) -> dict[str, Any]:
        opts: dict[str, Any] = dict(
            name=name, max_ongoing_requests=self.serve_max_ongoing_requests,
            max_queued_requests=self.max_queued_requests,
            ray_actor_options={"num_cpus": self.num_cpus * self.group, "num_gpus": self.num_gpus * self.group,
                               "resources": {k: v * self.group for k, v in self.resources.items()}})
        if self.ranks > 1:     # bundle 0 holds the replica (rank 0); the rank actors: see placement()
            opts["placement_group_bundles"], opts["placement_group_strategy"] = self.placement()
        if self.autoscaling:
            opts["autoscaling_config"] = self.autoscaling.model_dump(exclude_none=True)
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


class IngressConfig(_Strict):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.5, ge=0)
    resources: dict[str, float] = Field(default_factory=dict,
                                        description="custom node resources that pin the ingress (e.g. to the head)")
    max_ongoing_requests: int = Field(1024, ge=1)
    model_name: str | None = Field(None, description="the name /v1/models reports; default: the model dir's name")
    token_timeout_s: float = Field(60.0, gt=0, description="longest wait for the next token before the request fails")
    prefill_s_per_1k_tokens: float = Field(10.0, ge=0, description=(
        "the first token may take token_timeout_s plus this per 1,000 prompt tokens (prefill's own budget)"))
    max_body_bytes: Annotated[int, BeforeValidator(parse_bytes)] = Field(
        8 * MiB, gt=0, description="larger request bodies are refused with 413 (bytes, or e.g. 8MiB)")
    max_retries: int = Field(1, ge=0, description="re-runs of a request whose worker died mid-stream")
    retry_after_s: int = Field(1, ge=0, description="Retry-After sent with 503")
    decode_prefill_max_tokens: int = Field(0, ge=0, description=(
        "disaggregated: a prompt whose uncached part (after the prefix hint) is at most this many tokens is "
        "prefilled on the decode replica it is routed to, with no prefill call and no handoff (0: never)"))
    decode_prefill_queue: int = Field(0, ge=0, description=(
        "disaggregated: while this many prompts are in flight to the prefill pool from this ingress replica, "
        "a new one is prefilled on decode instead (0: never)"))
    api_keys: list[SecretStr] = Field(default_factory=list,
                                      description="accepted `Authorization: Bearer` keys; empty = no auth")
    allow_special_tokens_in_content: bool = Field(False, description=(
        "tokenize a special token's string in chat messages (`<｜Assistant｜>`, `</think>`, DSML) as the special "
        "token, as DeepSeek's encoder does; off: message text is always text"))


class HandoffConfig(_Strict):
    transport: Literal["nixl", "ray"] = "nixl"
    nixl_backend: str = "UCX"
    release_timeout_s: float = Field(30.0, gt=0, description="prefill frees held KV after this if decode never reads")


class PlannerSettings(_Strict):
    """Who sizes the pools (cluster/serve/planner.py, cluster/serve/autoscale.py)."""
    policy: Literal["ray", "planner", "dry-run"] = Field("ray", description=(
        "ray: each pool's own autoscaling (Ray Serve's request-count policy); planner: one application-level "
        "policy sizes the pools together from the TTFT / ITL targets; dry-run: the planner decides and logs, "
        "Serve's replica counts stay as they are"))
    slo_ttft_ms: float = Field(2000.0, gt=0, description="time-to-first-token target")
    slo_itl_ms: float = Field(200.0, gt=0, description="inter-token latency target (a request's p90 gap)")
    interval_s: float = Field(10.0, gt=0, description="seconds between the planner's decisions")
    max_total_replicas: int = Field(16, ge=1, description="replicas of all pools together")
    profile: dict[str, float] | None = Field(None, description=(
        "the start-up step-time profile (bench/pd_profile.py --json), over the built-in model's on CPU "
        "(cluster/serve/planner.py BUILTIN_CPU_PROFILE); an unknown key fails at start-up"))


class ServeConfig(_Strict):
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    engine: EngineSettings = EngineSettings()
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig = PoolConfig()
    colocated: PoolConfig = PoolConfig()
    ingress: IngressConfig = IngressConfig()
    handoff: HandoffConfig = HandoffConfig()
    planner: PlannerSettings = PlannerSettings()

    @model_validator(mode="after")
    def _planner_pools_autoscale(self):
        if self.planner.policy != "ray":
            pools = ("colocated",) if self.mode == "colocated" else ("prefill", "decode")
            fixed = [p for p in pools if getattr(self, p).autoscaling is None]
            if fixed:
                raise ValueError(f"planner.policy {self.planner.policy!r} sizes the pools within their autoscaling "
                                 f"bounds: set {', '.join(p + '.autoscaling' for p in fixed)} (min_replicas, "
                                 f"max_replicas)")
        return self

    def with_head_ip(self, head_ip: str) -> "ServeConfig":
        """`{head_ip}` in the index spec -> the Ray head's IP (Redis runs on the head);
        `{redis_password}` -> $KVMESH_REDIS_PASSWORD (so the password stays out of the file)."""
        index = self.engine.index.replace(HEAD_IP, head_ip)
        if REDIS_PASSWORD in index:
            if not os.environ.get(REDIS_PASSWORD_ENV):
                raise ConfigFileError(f"engine.index uses {REDIS_PASSWORD} but {REDIS_PASSWORD_ENV} is not set "
                                      "where the app is built (see deploy/README.md, secrets)")
            index = index.replace(REDIS_PASSWORD, quote(os.environ[REDIS_PASSWORD_ENV], safe=""))
        return self.model_copy(update={"engine": self.engine.model_copy(update={"index": index})})

    @model_validator(mode="after")
    def _valid_pool_engines(self):
        for name in ("prefill", "decode", "colocated"):
            try:
                self.pool_engine(getattr(self, name))
            except ValidationError as e:     # the pool's engine overrides, by EngineConfig's rules
                raise ValueError(f"{name}.engine: {_engine_message(e)}") from None
            except ConfigError as e:        # the pool's parallel sizes, as the engine checks them
                raise ValueError(f"{name}: {e}") from None
        return self

    def pool_engine(self, pool: PoolConfig, worker_id: str | None = None) -> EngineConfig:
        """The engine config a worker of `pool` runs: `engine`, then the pool's own overrides."""
        engine = self.engine
        changed = pool.engine.model_dump(exclude_unset=True)
        if changed:
            engine = EngineSettings.model_validate({**engine.model_dump(), **changed})
        config = engine.engine_config(worker_id)
        if pool.ranks > 1 or pool.enable_expert_parallel or pool.enable_eplb:
            config = dataclasses.replace(config, tensor_parallel_size=pool.tensor_parallel_size,
                                         data_parallel_size=pool.data_parallel_size,
                                         data_parallel_size_local=pool.data_parallel_size_local,
                                         enable_expert_parallel=pool.enable_expert_parallel,
                                         enable_eplb=pool.enable_eplb, eplb_config=pool.eplb_config)
        return config


def check_parallel_sizes(config: ServeConfig) -> None:
    """A pool whose tensor_parallel_size or data_parallel_size cannot split the model fails here,
    before anything is deployed, when the checkpoint's config.json is readable where the app is
    built (else the replica fails at start-up with the same message)."""
    from kvmesh.workers.checkpoint.default_model import default_model_dir
    path = Path(config.engine.model or default_model_dir()) / "config.json"
    pools = ["colocated"] if config.mode == "colocated" else ["prefill", "decode"]
    sized = [(name, getattr(config, name)) for name in pools]
    if not path.is_file() or all(p.ranks == 1 for _, p in sized):
        return
    from kvmesh.workers.checkpoint.sharding import check_sizes
    from kvmesh.workers.engine.data_parallel import check_dp_sizes
    from kvmesh.workers.model.args import ModelArgs
    args = ModelArgs.from_file(path)
    for name, pool in sized:
        try:
            if pool.data_parallel_size > 1:
                check_dp_sizes(args, pool.data_parallel_size, pool.tensor_parallel_size)
            else:
                check_sizes(args, pool.tensor_parallel_size, pool.enable_expert_parallel)
        except ConfigError as e:
            key = "data_parallel_size" if pool.data_parallel_size > 1 else "tensor_parallel_size"
            raise ConfigFileError(f"{name}.{key}: {e}") from None


def read_config_file(path: str | os.PathLike | None) -> dict[str, Any]:
    """The config tree of a kvmesh config (or of a Serve config file's first application args),
    unvalidated; no file = {} (the embedded defaults)."""
    if path is None:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigFileError(f"cannot read config {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"config {path}: expected a mapping at the top level")
    if "applications" in data:
        data = (data["applications"] or [{}])[0].get("args") or {}
    return data


def load_config(path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None,
                data: dict[str, Any] | None = None) -> ServeConfig:
    """Read a kvmesh config (or a Serve config file's first application args), then apply
    dotted `overrides` ({"engine.model": DIR}). No file = the embedded defaults. `data`: the
    tree `read_config_file(path)` already read (it is changed in place)."""
    data = read_config_file(path) if data is None else data
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            if node.get(key) is None:          # absent, or an empty YAML section (`prefill:`)
                node[key] = {}
            node = node[key]
        node[leaf] = value
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigFileError(f"config {path or '(defaults)'}: {e}") from None
