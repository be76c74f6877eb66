"""`kvmesh serve`'s `vllm serve` flags: what a user sets on the command line without writing a config.

    kvmesh serve --tensor-parallel-size 2 --enable-expert-parallel --kv-cache-dtype fp8 \\
                 --max-model-len 65536 --max-num-seqs 32 --decode-max-num-seqs 128 --served-model-name v4
    kvmesh serve --mode colocated --data-parallel-size 2 --enable-expert-parallel
    kvmesh serve --data-parallel-size 2 --enable-expert-parallel --enable-eplb \\
                 --eplb-config '{"num_redundant_experts": 2, "step_interval": 500}'

A plain flag sets every pool the mode runs (prefill and decode, or the colocated pool); its
`--prefill-*` / `--decode-*` form sets one pool and wins over the plain flag there. Each flag
becomes one config key (`prefill.tensor_parallel_size`, `decode.engine.max_num_seqs`,
`engine.kv_cache_dtype`, `ingress.model_name`, `colocated.data_parallel_size`) and never silently
overrides the config file: where the file sets that key (or the `engine` key a pool inherits) to
another value, it is an error naming both. `--data-parallel-size` N > 1 serves every pool the mode
runs data-parallel (it needs `--enable-expert-parallel`); prefill and decode pools hand off rank to
rank (engine/data_parallel.py). `--data-parallel-size-local` N (ranks per node) is checked as the
config key is; a value that would spread a replica over several nodes is refused, as it is not
served yet.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, get_args

from kvmesh.workers.engine_config import EngineConfig

from kvmesh.cluster.config import ConfigFileError, IngressConfig, PoolConfig

POOLS = ("prefill", "decode")
# PoolConfig's: they size the placement group
POOL_KEYS = ("tensor_parallel_size", "data_parallel_size", "data_parallel_size_local", "enable_expert_parallel",
             "enable_eplb", "eplb_config")
PER_POOL_ENGINE_KEYS = ("max_model_len", "max_num_seqs")               # EngineConfig's, a pool may differ
SHARED_ENGINE_KEYS = ("kv_cache_dtype",)    # part of the cache layout: prefill and decode must agree to hand off


class ServeFlagError(ConfigFileError):
    """A serve flag disagrees with the config file or names a pool the mode does not run."""


def _flag(name: str, pool: str | None = None) -> str:
    return "--" + (f"{pool}_" if pool else "").replace("_", "-") + name.replace("_", "-")


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's names; help, types and choices from the config fields they set."""
    engine = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for name in POOL_KEYS + PER_POOL_ENGINE_KEYS + SHARED_ENGINE_KEYS:
        if name in POOL_KEYS:
            field = PoolConfig.model_fields[name]
            kind = next((t for t in get_args(field.annotation) if t is not type(None)), field.annotation)
            help_, choices = field.description.split(":")[0], None
            kind = json_object if name == "eplb_config" else kind
        else:
            kind = int if name in PER_POOL_ENGINE_KEYS else str
            help_, choices = engine[name].metadata["help"], engine[name].metadata.get("choices")
        metavar = None if choices or kind is bool else "JSON" if kind is json_object else "N"
        for pool in [None] + (list(POOLS) if name not in SHARED_ENGINE_KEYS else []):
            text = (f"{help_} (every pool; config key {_config_key(name, 'POOL')})" if pool is None else
                    f"{_flag(name)} for the {pool} pool only (config key {_config_key(name, pool)})")
            if kind is bool:
                p.add_argument(_flag(name, pool), action=argparse.BooleanOptionalAction, default=None, help=text)
            else:
                p.add_argument(_flag(name, pool), type=kind, default=None, choices=choices, metavar=metavar,
                               help=text)
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help=IngressConfig.model_fields["model_name"].description + " (config key ingress.model_name)")
    p.add_argument("--allow-special-tokens-in-content", action="store_true", default=None,
                   help=IngressConfig.model_fields["allow_special_tokens_in_content"].description
                   + " (config key ingress.allow_special_tokens_in_content)")


def json_object(text: str) -> dict:
    """`--eplb-config '{"num_redundant_experts": 2}'` -> a dict (argparse names the flag when this fails)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(text)
    return value


def _config_key(name: str, pool: str) -> str:
    """Where the flag's value goes (a per-pool engine key also checks the `engine` key it inherits)."""
    if name in POOL_KEYS:
        return f"{pool}.{name}"
    return f"engine.{name}" if name in SHARED_ENGINE_KEYS else f"{pool}.engine.{name}"


def _get(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _agree(flag: str, value: Any, data: dict[str, Any], keys: list[str], source: str) -> None:
    """The first of `keys` the file sets (None counts as unset) must equal the flag's value."""
    for key in keys:
        given = _get(data, key)
        if given is not None:
            if given != value:
                shown = (flag if value else "--no-" + flag[2:]) if isinstance(value, bool) else f"{flag} {value}"
                raise ServeFlagError(f"{shown} disagrees with {key}: {given} in {source}; "
                                     "drop one of them or make them equal")
            return


def flag_overrides(args: argparse.Namespace, data: dict[str, Any], source: str) -> dict[str, Any]:
    """`load_config`'s dotted overrides for the vLLM flags given in `args`. `data` is the config
    file's tree (`read_config_file`), read to refuse a flag that disagrees with it."""
    mode = args.mode or data.get("mode") or "disaggregated"
    pools = ("colocated",) if mode == "colocated" else POOLS
    out: dict[str, Any] = {}
    for name in POOL_KEYS + PER_POOL_ENGINE_KEYS:
        plain = getattr(args, name)
        for pool in POOLS:
            if getattr(args, f"{pool}_{name}") is not None and pool not in pools:
                raise ServeFlagError(f"{_flag(name, pool)} sets the {pool} pool, but mode {mode} runs one pool "
                                     f"(colocated): use {_flag(name)}")
        for pool in pools:
            specific = getattr(args, f"{pool}_{name}", None)
            value, flag = (specific, _flag(name, pool)) if specific is not None else (plain, _flag(name))
            if value is None:
                continue
            key = _config_key(name, pool)
            _agree(flag, value, data, [key] if name in POOL_KEYS else [key, f"engine.{name}"], source)
            out[key] = value
    for name in SHARED_ENGINE_KEYS:
        value = getattr(args, name)
        if value is not None:
            for key in [f"engine.{name}"] + [f"{pool}.engine.{name}" for pool in POOLS + ("colocated",)]:
                _agree(_flag(name), value, data, [key], source)
            out[f"engine.{name}"] = value
    if args.served_model_name is not None:
        _agree("--served-model-name", args.served_model_name, data, ["ingress.model_name"], source)
        out["ingress.model_name"] = args.served_model_name
    if args.allow_special_tokens_in_content:
        key = "ingress.allow_special_tokens_in_content"
        _agree("--allow-special-tokens-in-content", True, data, [key], source)
        out[key] = True
    return out
