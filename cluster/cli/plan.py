"""``kvmesh plan``: will a model fit, at which tensor- / data- / expert-parallel size, with how much KV?

    kvmesh plan --config V4-Pro --gpu-memory 141 --gpus 8 [--kv-cache-dtype fp8] [--context 1048576]
    kvmesh plan --config V4-Pro --gpu-memory 80 --gpus 8 [--nodes 4]
    kvmesh plan --model DIR --gpu-memory 80 --gpus 4

`--config` is a config.json or a released shape (V4-Flash, V4-Pro: workers/checkpoint/released.py);
`--model` reads the checkpoint's safetensors headers (bytes as stored). The numbers are
`kvmesh.workers.checkpoint.sizing`'s; nothing is loaded. Rows are TP sizes (every rank holds the same
cache) and DP sizes with expert parallelism (each DP rank its own cache: the KV a node holds
grows with the ranks). A DP + EP replica may span several nodes (`nodes` > 1: whole nodes, `--gpus`
ranks on each); `--nodes auto` (the default) adds those rows only where nothing fits on one node,
up to the fewest nodes where something does; `--nodes N` lists every size up to N nodes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="weights per rank, KV bytes per token, tokens that fit, TP/DP/EP sizes that fit")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory (weights from its safetensors headers)")
    src.add_argument("--config", help="config.json alone, or a released shape: V4-Flash, V4-Pro")
    p.add_argument("--gpu-memory", type=float, required=True, metavar="GiB", help="memory of one device, GiB")
    p.add_argument("--gpus", type=int, required=True, metavar="N",
                   help="devices per node (a replica on one node: TP x DP up to N; over several nodes: N ranks on each)")
    p.add_argument("--nodes", default="auto", metavar="N|auto",
                   help="most nodes one DP + EP replica may span (default auto: one node, or where nothing fits "
                        "there, the fewest nodes where something does; 1: one node only)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16", "fp8"], default="auto",
                   help="compressed entries + indexer keys (default auto = the compute dtype)")
    p.add_argument("--context", type=int, help="tokens per request for the `requests` column "
                                                "(default: max_position_embeddings)")
    p.add_argument("--block-tokens", type=int, default=128)
    p.add_argument("--swa-policy", default="full",
                   help="full (blocks also hold SWA K=V, the engine default) | periodic:P | zero | auto")
    p.add_argument("--reserve", type=float, default=None,
                   help="fraction of device memory kept for activations, CUDA context and NCCL buffers (default 0.10)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(handler=run_plan)


def _sources(args: argparse.Namespace):
    from kvmesh.workers.checkpoint.released import RELEASED_CONFIGS
    from kvmesh.workers.checkpoint.sizing import split_from_checkpoint, split_from_config
    from kvmesh.workers.model.args import ModelArgs
    if args.model:
        model_args = ModelArgs.from_file(Path(args.model) / "config.json")
        return args.model, model_args, split_from_checkpoint(args.model)
    if args.config in RELEASED_CONFIGS and not Path(args.config).exists():
        model_args = ModelArgs.from_dict(RELEASED_CONFIGS[args.config], args.config)
    else:
        model_args = ModelArgs.from_file(Path(args.config))
    return args.config, model_args, split_from_config(model_args)


def run_plan(args: argparse.Namespace) -> int:
    from kvmesh.workers.checkpoint.loader import CheckpointError
    from kvmesh.workers.checkpoint.sizing import DEFAULT_RESERVE, SizingError, format_plan, parse_nodes, plan
    from kvmesh.workers.model.args import ConfigError
    try:
        nodes = parse_nodes(args.nodes)
        label, model_args, weights = _sources(args)
        p = plan(model_args, weights, args.gpu_memory, args.gpus, kv_cache_dtype=args.kv_cache_dtype,
                 context=args.context, block_tokens=args.block_tokens, swa_policy=args.swa_policy,
                 reserve=DEFAULT_RESERVE if args.reserve is None else args.reserve, nodes=nodes)
    except (ConfigError, CheckpointError, SizingError, ValueError) as e:
        print(f"kvmesh plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"params": weights.params, "weight_bytes": weights.total,
                          "kv_bytes_per_token": p.kv_bytes_per_token, "slot_bytes": p.layout.slot_bytes,
                          "gpus_per_node": p.gpus, "nodes": p.nodes,
                          "sizes": [{"tp": f.tp, "dp": f.dp, "expert_parallel": f.expert_parallel, "nodes": f.nodes,
                                     "data_parallel_size_local": f.dp_local, "fits": f.fits,
                                     "problems": list(f.problems), "served": True,    # every size planned
                                     "weights_per_rank": f.weights_per_rank,
                                     "free_per_rank": f.free_per_rank, "tokens": f.tokens,
                                     "tokens_per_node": f.tokens_per_node,
                                     "max_context": f.max_context, "requests_at_context": f.requests_at_context,
                                     "replicas_per_node": f.replicas_per_node} for f in p.fits]}))
    else:
        print(format_plan(p, label))
    return 0
