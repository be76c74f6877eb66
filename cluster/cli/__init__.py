"""`kvmesh` command line: one module per command, each with `add_parser(subparsers)`.

    generate.py    kvmesh generate: a JSONL batch through one engine (one flag per EngineConfig field)
    inspect.py     kvmesh layout / kvmesh inspect: cache sizes for a config, a checkpoint's bytes
    plan.py        kvmesh plan: TP and DP + EP layouts that fit a node, with their KV tokens
    simulate.py    kvmesh simulate: a SWA policy projected to V4's shape on a request trace
    store.py       kvmesh store: list / verify / clean the shared store's namespaces
    serve.py       kvmesh serve: the Serve app on a local or running Ray (serve_flags.py: vLLM's flags)
    node_role.py   `python -m kvmesh.cluster.cli.node_role`: a `ray up` machine's pool resources

A command module that fails to import is an error at start-up, never a missing command.
"""
from __future__ import annotations

import argparse
import importlib

COMMANDS = ("generate", "inspect", "store", "simulate", "plan", "serve")   # modules of this package


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh", description="kvmesh command line: generate (offline batch), layout, inspect, plan, "
                                   "simulate, store, serve.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)

