"""`kvmesh store stats|ls|gc`: inspect and trim a kvmesh object store.

Wired into the main CLI with `add_parser(subparsers)`; the parsed
arguments go to `run_store(args)`, which returns a process exit code. Also
runnable alone: `python -m cluster.cli.store store stats --store /path`.

Every command works per namespace (`{root}/{fingerprint[:16]}`, or
`{root}/{fingerprint[:16]}-k{key_id}` for objects written under a store key): all
namespaces under the store root, those of one fingerprint (`--fingerprint`, the full
fingerprint or its 16-char prefix), or one namespace by name (`--namespace`, as `stats`
prints it: how an old key's namespace is removed after a key rotation). `--capacity` is
per namespace, as it is for `ObjectStore`. No command needs the store key: none reads
an object's contents.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from kvstore.index import make_index
from kvstore.objects import KINDS
from kvstore.store import ObjectStore, list_namespaces


class StoreCliError(Exception):
    """A store command cannot run as asked; the message says why."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `store` command (with `stats`, `ls`, `gc`) to a CLI."""
    parser = subparsers.add_parser("store", help="inspect and trim the KV object store")
    commands = parser.add_subparsers(dest="store_command", required=True)
    for name, help_text in (
        ("stats", "objects and bytes per namespace and kind"),
        ("ls", "list the objects of each namespace"),
        ("gc", "evict least recently used objects down to --capacity"),
    ):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--store", required=True, help="store URI: a path, file://..., s3://...")
        sub.add_argument("--fingerprint", help="only this namespace (full fingerprint or 16-char prefix)")
        sub.add_argument("--namespace", help="only this namespace directory (as `stats` names it)")
        sub.add_argument("--capacity", type=int, help="bytes per namespace (required for gc)")
        if name == "gc":
            sub.add_argument("--index", help="also unpublish evicted objects from this index spec")
            sub.add_argument("--all", action="store_true", help="evict every object (e.g. an old key's namespace)")
    parser.set_defaults(handler=run_store)
    return parser


def run_store(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run a parsed `store` command; return 0 on success, 2 on a usage error."""
    out = out or sys.stdout
    try:
        stores = _open_stores(args)
        if args.store_command == "stats":
            _print_stats(stores, out)
        elif args.store_command == "ls":
            _print_listing(stores, out)
        else:
            _gc(stores, args, out)
    except (StoreCliError, ValueError) as e:
        print(f"kvmesh store: {e}", file=sys.stderr)
        return 2
    return 0


def _open_stores(args: argparse.Namespace) -> list[ObjectStore]:
    if args.capacity is not None and args.capacity <= 0:
        raise StoreCliError(f"--capacity must be a positive number of bytes, got {args.capacity}")
    namespaces = list_namespaces(args.store)
    wanted, name = args.fingerprint, getattr(args, "namespace", None)
    if wanted is not None:
        namespaces = {ns: fp for ns, fp in namespaces.items() if ns[:16] == wanted[:16]}
        if not namespaces:
            raise StoreCliError(f"no namespace for fingerprint {wanted} in {args.store}")
    if name is not None:
        namespaces = {ns: fp for ns, fp in namespaces.items() if ns == name}
        if not namespaces:
            raise StoreCliError(f"no namespace {name} in {args.store}")
    stores = []
    for ns, fingerprint in sorted(namespaces.items()):
        if fingerprint is None:
            print(f"skipping {ns}: no FINGERPRINT file (not written by kvmesh)", file=sys.stderr)
            continue
        stores.append(ObjectStore(args.store, fingerprint, args.capacity, namespace=ns))
    return stores


def _print_stats(stores: list[ObjectStore], out: TextIO) -> None:
    row = "{:<35}  {:<10}  {:>9}  {:>14}  {:>14}"
    print(row.format("namespace", "kind", "objects", "bytes", "capacity"), file=out)
    for store in stores:
        stats = store.stats()
        capacity = "-" if stats.capacity_bytes is None else str(stats.capacity_bytes)
        for kind in KINDS:
            print(row.format(store.namespace, kind, stats.objects[kind], stats.bytes[kind], ""), file=out)
        total = sum(stats.objects.values())
        print(row.format(store.namespace, "total", total, stats.total_bytes, capacity), file=out)


def _print_listing(stores: list[ObjectStore], out: TextIO) -> None:
    for store in stores:
        print(f"{store.fingerprint}" + (f" ({store.namespace})" if "-k" in store.namespace else ""), file=out)
        for kind in KINDS:
            for h in sorted(store.list(kind)):
                print(f"  {kind}/{h:016x}", file=out)


def _gc(stores: list[ObjectStore], args: argparse.Namespace, out: TextIO) -> None:
    if args.capacity is None and not args.all:
        raise StoreCliError("gc needs --capacity BYTES (the size to evict down to, per namespace) or --all")
    for store in stores:
        index = make_index(args.index, store.fingerprint, namespace=store.namespace) if args.index else None
        store.attach_index(index)
        try:
            evicted = store.gc(0 if args.all else None)
        finally:
            if index is not None:
                index.close()
        stats = store.stats()
        print(
            f"{store.namespace}: evicted {evicted} objects, "
            f"{stats.total_bytes} of {0 if args.all else args.capacity} bytes used",
            file=out,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run_store(args)


if __name__ == "__main__":
    sys.exit(main())
