"""`kvmesh generate`: a JSONL batch file through one engine, all lines concurrently.

A bad line (malformed JSON, missing id or prompt, invalid sampling values, prompt too
long) gets an `error` result; the other lines complete. The exit status is 1 whenever
any line did not complete (bad input, or a request that failed in the engine: its
result has `finish_reason: "error"` and an `error` field).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

FIELDS = {"id", "prompt", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed",
          "ignore_eos", "stop_token_ids", "min_tokens"}


def parse_line(line: str, lineno: int):
    """-> (id, prompt, SamplingParams); raises InvalidRequestError naming the problem."""
    from kvmesh.workers.sampling.params import InvalidRequestError, SamplingParams
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"line {lineno}: invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"line {lineno}: expected a JSON object")
    unknown = set(obj) - FIELDS
    if unknown:
        raise InvalidRequestError(f"line {lineno}: unknown fields {sorted(unknown)}")
    if not isinstance(obj.get("id"), str):
        raise InvalidRequestError(f"line {lineno}: 'id' (string) is required")
    if ("prompt" in obj) == ("prompt_token_ids" in obj):
        raise InvalidRequestError(f"line {lineno}: give exactly one of 'prompt' or 'prompt_token_ids'")
    prompt = obj.get("prompt", obj.get("prompt_token_ids"))
    if "prompt" in obj and not isinstance(prompt, str):
        raise InvalidRequestError(f"line {lineno}: 'prompt' must be a string")
    kw = {k: obj[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "min_tokens")
          if k in obj}
    if "stop_token_ids" in obj:
        stops = obj["stop_token_ids"]  # anything but a list is left for validate() to name
        kw["stop_token_ids"] = tuple(stops) if isinstance(stops, list) else stops
    return obj["id"], prompt, SamplingParams(**kw).validate()


def run_batch_file(config, input_path: Path, output_path: Path | None) -> int:
    from kvmesh.workers.engine import open_engine
    from kvmesh.workers.sampling.params import InvalidRequestError
    try:
        lines = input_path.read_text().splitlines()
    except OSError as e:
        print(f"kvmesh generate: cannot read {input_path}: {e}", file=sys.stderr)
        return 2
    try:
        engine = open_engine(config)          # data_parallel_size > 1: a DataParallelEngine
    except Exception as e:  # a bad checkpoint, config, policy or store URI: say which and stop
        print(f"kvmesh generate: {e}", file=sys.stderr)
        return 2
    results: dict[int, dict] = {}
    order: dict[str, int] = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rid, prompt, params = parse_line(line, i + 1)
            engine.add_request(rid, prompt, params)
            order[rid] = i
        except InvalidRequestError as e:
            rid = _maybe_id(line)
            results[i] = {"id": rid, "error": str(e), "finish_reason": "error"}
    bar = tqdm(total=len(order), desc="requests", file=sys.stderr, disable=not order)
    try:
        _run(engine, order, results, bar)
    except Exception as e:  # the engine itself failed: every line still open gets the error
        print(f"kvmesh generate: the engine failed: {type(e).__name__}: {e}", file=sys.stderr)
        for rid, i in order.items():
            results.setdefault(i, {"id": rid, "error": f"engine failed: {type(e).__name__}: {e}",
                                   "finish_reason": "error"})
    bar.close()
    _report_drafts(engine)
    try:
        engine.flush()
        engine.close()
    except Exception as e:
        print(f"kvmesh generate: persisting the cache failed: {e}", file=sys.stderr)
    text = "".join(json.dumps(results[i]) + "\n" for i in sorted(results))
    if output_path:
        output_path.write_text(text)
    else:
        sys.stdout.write(text)
    return 0 if all("error" not in r for r in results.values()) else 1


def _run(engine, order: dict[str, int], results: dict[int, dict], bar) -> None:
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                result = {
                    "id": out.request_id, "token_ids": out.token_ids, "text": out.text,
                    "logprobs": out.logprobs, "finish_reason": out.finish_reason,
                    "prompt_tokens": out.prompt_tokens, "cached_tokens": out.cached_tokens}
                if out.error or out.finish_reason not in ("stop", "length"):
                    result["error"] = out.error or f"the request ended with finish_reason {out.finish_reason!r}"
                results[order[out.request_id]] = result
                bar.update(1)


def _report_drafts(engine) -> None:
    """One stderr line on speculative decoding (every rank's drafts), when the engine drafted."""
    c = engine.stats().counters
    if c.draft_tokens:
        print(f"kvmesh generate: speculative decoding: {c.draft_tokens} draft tokens, "
              f"{c.accepted_draft_tokens / c.draft_tokens:.0%} accepted", file=sys.stderr)


def _maybe_id(line: str):
    try:
        obj = json.loads(line)
        return obj.get("id") if isinstance(obj, dict) else None
    except json.JSONDecodeError:
        return None


def add_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="run a JSONL batch of requests through one engine")
    _add_engine_args(g)
    g.add_argument("--input", required=True, help="requests.jsonl")
    g.add_argument("--output", help="results.jsonl (default: stdout)")
    g.set_defaults(handler=cmd_generate)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (`--kv-cache-bytes`, ...): name, default, help and
    choices come from the field, so a new engine setting is a new flag with no edit here."""
    import dataclasses
    from typing import get_type_hints

    from kvmesh.workers.engine_config import EngineConfig
    hints = get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if not f.metadata.get("cli", True):
            continue
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        text = meta.get("help", "")
        help = text if "default" in text else f"{text} (default: {_shown(f.default)})"
        kind = next(t for t in (bool, str, int, float) if t in getattr(hints[f.name], "__args__", (hints[f.name],)))
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help)
        elif meta.get("unit") == "bytes":
            p.add_argument(flag, default=f.default, metavar="BYTES", help=help + "; bytes, or with a suffix: 512MiB")
        else:
            p.add_argument(flag, type=kind, default=f.default, choices=meta.get("choices"), help=help)


def _shown(default) -> str:
    if isinstance(default, int) and not isinstance(default, bool) and default >= 1 << 20 and not default % (1 << 20):
        return f"{default >> 20}MiB"
    return "none" if default is None else str(default)


def engine_config(args: argparse.Namespace):
    """The engine config from the flags; the store key comes from KVMESH_STORE_KEY."""
    import dataclasses
    import os

    from kvmesh.workers.engine_config import EngineConfig
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True)}
    return EngineConfig(store_key=os.environ.get("KVMESH_STORE_KEY") or None, **flags)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvmesh.workers.model.args import ConfigError

    try:
        config = engine_config(args)
    except ConfigError as e:
        print(f"kvmesh generate: {e}", file=sys.stderr)
        return 2
    return run_batch_file(config, Path(args.input), Path(args.output) if args.output else None)
