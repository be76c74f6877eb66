"""`kvmesh layout` (cache sizes for a model config) and `kvmesh inspect` (a checkpoint's
parameters and bytes per dtype, resident bytes, KV bytes)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    lay = sub.add_parser("layout", help="cache sizes for a model config")
    lay.add_argument("--model")
    lay.add_argument("--config")
    lay.add_argument("--context", type=int, default=1 << 20)
    lay.add_argument("--block-tokens", type=int, default=128)
    lay.add_argument("--dtype", default=None, help="cache dtype (default bfloat16)")
    lay.set_defaults(handler=cmd_layout)
    ins = sub.add_parser("inspect", help="a checkpoint's parameters and bytes per dtype, resident bytes, KV bytes")
    ins.add_argument("--model", required=True)
    ins.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="compute dtype (default: checkpoint's)")
    ins.add_argument("--block-tokens", type=int, default=128)
    ins.set_defaults(handler=cmd_inspect)


def cmd_layout(args: argparse.Namespace) -> int:
    from kvmesh.kvstore.device.layout import CacheLayout, LayoutParams
    from kvmesh.workers.model.args import ConfigError, ModelArgs
    if not (args.model or args.config):
        print("kvmesh layout: give --model DIR or --config config.json", file=sys.stderr)
        return 2
    try:
        a = ModelArgs.from_file(Path(args.config) if args.config else Path(args.model) / "config.json")
        layouts = {kv: CacheLayout.build(LayoutParams(a.layer_types, a.head_dim, a.index_head_dim, a.csa_ratio,
                                                      a.hca_ratio, a.sliding_window, args.dtype or "bfloat16",
                                                      kv, a.rope_head_dim), args.block_tokens)
                   for kv in ("auto", "fp8")}
    except (ConfigError, ValueError) as e:
        print(f"kvmesh layout: {e}", file=sys.stderr)
        return 2
    print(format_layout(layouts["auto"], args.context))
    print()
    print(format_kv_dtypes(layouts))
    return 0


def format_kv_dtypes(layouts: dict) -> str:
    """Classical cache per token and per 1M tokens, for each kv_cache_dtype."""
    rows = [("kv_cache_dtype", "B/token", "GiB per 1M tokens", "vs first")]
    base = None
    for kv, layout in layouts.items():
        per_token = layout.bytes_per_token()
        base = base or per_token
        name = layout.params.entry_dtype if kv == "auto" else kv
        rows.append((name, f"{per_token:,.1f}", f"{per_token * 1e6 / 2**30:,.2f}", f"{per_token / base:.3f}x"))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(f"{r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]:>{w[3]}}" for r in rows)


def cmd_inspect(args: argparse.Namespace) -> int:
    from kvmesh.kvstore.device.layout import CacheLayout, LayoutParams
    from kvmesh.workers.checkpoint.inspect import format_stats, resident_bytes, weight_stats
    from kvmesh.workers.checkpoint.loader import CheckpointError, load_model
    try:
        stats = weight_stats(Path(args.model))
        margs, model = load_model(args.model, dtype=args.dtype)
    except CheckpointError as e:
        print(f"kvmesh inspect: {e}", file=sys.stderr)
        return 2
    resident = resident_bytes(model)
    quant = margs.raw.get("quantization_config")
    print(format_stats(stats))
    print(f"quantization: {json.dumps(quant) if quant else 'none'}; expert_dtype "
          f"{(quant or {}).get('expert_dtype', margs.raw.get('expert_dtype', '-'))}")
    print(f"MTP layers: {len(model.mtp)} ({stats.mtp_params:,} params, loaded and kept)")
    print(f"resident after load: {resident:,} B ({resident / 2**30:.2f} GiB), "
          f"{resident / max(stats.file_bytes, 1):.3f}x the file's tensor bytes")
    dtype = str(model.head.weight.dtype).removeprefix("torch.")
    for kv in ("auto", "fp8"):
        layout = CacheLayout.build(LayoutParams(margs.layer_types, margs.head_dim, margs.index_head_dim,
                                                margs.csa_ratio, margs.hca_ratio, margs.sliding_window, dtype,
                                                kv, margs.rope_head_dim), args.block_tokens)
        print(f"KV cache (kv_cache_dtype {layout.params.entry_dtype}, block_tokens {args.block_tokens}): "
              f"{layout.bytes_per_token():,.1f} B/token classical, {layout.swa_bytes_per_token():,.0f} B/token "
              f"SWA K=V, {layout.slot_bytes:,} B per state slot")
    return 0


def format_layout(layout, context: int) -> str:
    counts, per_type = layout.layer_count_by_type(), layout.bytes_per_token_by_type()
    rows = [("layer type", "layers", "classical B/token")]
    for t in ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"):
        if t in counts:
            rows.append((t, str(counts[t]), f"{per_type[t]:,.1f}"))
    rows.append(("total", str(sum(counts.values())), f"{layout.bytes_per_token():,.1f}"))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}" for r in rows]
    classical = layout.bytes_per_token() * context
    lines += ["",
              f"dtype {layout.params.dtype}, block_tokens {layout.block_tokens}: "
              f"{layout.block_bytes:,} B per block",
              f"state slot (SWA rings + tails + overlap): {layout.slot_bytes:,} B per request",
              f"SWA K=V: {layout.swa_bytes_per_token():,.0f} B/token (what the `full` policy persists)",
              f"footprint at {context:,} tokens: classical {classical:,.0f} B ({classical / 2**30:.2f} GiB), "
              f"with one state slot {classical + layout.slot_bytes:,.0f} B"]
    return "\n".join(lines)
