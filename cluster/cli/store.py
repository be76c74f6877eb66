"""`kvmesh store stats|ls|gc|scrub`: inspect, trim and check a kvmesh object store.

Wired into the main CLI with `add_parser(subparsers)`; the parsed
arguments go to `run_store(args)`, which returns a process exit code. Also
runnable alone: `python -m kvmesh.cluster.cli.store store stats --store /path`.

Every command works per namespace (`{root}/{fingerprint[:16]}`, or
`{root}/{fingerprint[:16]}-k{key_id}` for objects written under a store key): all
namespaces under the store root, those of one fingerprint (`--fingerprint`, the full
fingerprint or its 16-char prefix), or one namespace by name (`--namespace`, as `stats`
prints it: how an old key's namespace is removed after a key rotation). `--capacity` is
per namespace, as it is for `ObjectStore`. Only `scrub` reads objects' contents (kvstore.store.scrub):
it verifies MACs in the namespace of the key in $KVMESH_STORE_KEY, and checksums alone in
every other namespace (a key is never applied to another key's objects).

The key is read as serving reads it ($KVMESH_STORE_KEY; unset or empty is no key, one under 16
bytes an error). Serving's warning that the store has no key is given only when that is true
here: no key is set and a namespace the command opens was written without one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TextIO

from kvmesh.kvstore.index.embedded import make_index
from kvmesh.kvstore.store.mac import StoreKey
from kvmesh.kvstore.store.objects import KINDS
from kvmesh.kvstore.store.scrub import REASONS, ScrubReport, Scrubber
from kvmesh.kvstore.store.object_store import ObjectStore, list_namespaces, warn_unkeyed
from kvmesh.kvstore.store.store_fs import STALE_TMP_S

STORE_KEY_ENV = "KVMESH_STORE_KEY"


class StoreCliError(Exception):
    """A store command cannot run as asked; the message says why."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `store` command (with `stats`, `ls`, `gc`, `scrub`) to a CLI."""
    parser = subparsers.add_parser("store", help="inspect and trim the KV object store")
    commands = parser.add_subparsers(dest="store_command", required=True)
    for name, help_text in (
        ("stats", "objects and bytes per namespace and kind"),
        ("ls", "list the objects of each namespace"),
        ("gc", "evict least recently used objects down to --capacity"),
        ("scrub", "verify every object; remove (or quarantine) what fails and stale temp files"),
    ):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--store", required=True, help="store URI: a path, file://..., s3://...")
        sub.add_argument("--fingerprint", help="only this namespace (full fingerprint or 16-char prefix)")
        sub.add_argument("--namespace", help="only this namespace directory (as `stats` names it)")
        if name != "scrub":
            sub.add_argument("--capacity", type=int, help="bytes per namespace (required for gc)")
        if name in ("gc", "scrub"):
            sub.add_argument("--index", help=f"also unpublish {'evicted' if name == 'gc' else 'removed'} objects "
                                             "from this index spec")
        if name == "gc":
            sub.add_argument("--all", action="store_true", help="evict every object (e.g. an old key's namespace)")
        if name == "scrub":
            sub.add_argument("--dry-run", action="store_true", help="only report what fails; change nothing")
            sub.add_argument("--json", action="store_true", help="print one JSON object per namespace")
            sub.add_argument("--tmp-grace-s", type=float, default=STALE_TMP_S,
                             help="temp files of interrupted writes older than this (s) are removed")
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
        elif args.store_command == "scrub":
            _scrub(stores, args, out)
        else:
            _gc(stores, args, out)
    except (StoreCliError, ValueError) as e:
        print(f"kvmesh store: {e}", file=sys.stderr)
        return 2
    return 0


def _open_stores(args: argparse.Namespace) -> list[ObjectStore]:
    capacity = getattr(args, "capacity", None)
    if capacity is not None and capacity <= 0:
        raise StoreCliError(f"--capacity must be a positive number of bytes, got {capacity}")
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
    key = _store_key()
    stores = []
    for ns, fingerprint in sorted(namespaces.items()):
        if fingerprint is None:
            print(f"skipping {ns}: no FINGERPRINT file (not written by kvmesh)", file=sys.stderr)
            continue
        stores.append(ObjectStore(args.store, fingerprint, capacity, namespace=ns, key=_key_of(ns, key)))
    if key is None and any(not _keyed(store.namespace) for store in stores):
        warn_unkeyed(args.store)
    return stores


def _store_key() -> StoreKey | None:
    """The key in $KVMESH_STORE_KEY, read as serving reads it (cluster/config.py): unset or empty
    is no key; one too short is an error naming the variable, as it stops serving."""
    secret = os.environ.get(STORE_KEY_ENV) or None
    try:
        return StoreKey(secret) if secret else None
    except ValueError as e:
        raise StoreCliError(f"{STORE_KEY_ENV}: {e}") from None


def _keyed(namespace: str) -> bool:
    """Whether `namespace` holds objects written under a store key (`{fingerprint[:16]}-k{key_id}`)."""
    return "-k" in namespace


def _key_of(namespace: str, key: StoreKey | None) -> StoreKey | None:
    """`key` when `namespace` is that key's (then scrub verifies MACs), else None: a key is never
    applied to another key's objects, nor to unkeyed ones."""
    return key if key is not None and namespace.endswith(f"-k{key.key_id}") else None


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
        print(f"{store.fingerprint}" + (f" ({store.namespace})" if _keyed(store.namespace) else ""), file=out)
        for kind in KINDS:
            for h in sorted(store.list(kind)):
                print(f"  {kind}/{h:016x}", file=out)


def _scrub(stores: list[ObjectStore], args: argparse.Namespace, out: TextIO) -> None:
    row = "{:<35}  {:>8}  {:>8}  {:>8}  {:>11}  {:>9}  {:>12}  {:>7}"
    if not args.json:
        print(row.format("namespace", "checked", "ok", "removed", "quarantined", "untouched", "bytes_read",
                         "seconds"), file=out)
    key = _store_key()
    for store in stores:
        if _keyed(store.namespace) and _key_of(store.namespace, key) is None:
            print(f"{store.namespace}: without its key ({STORE_KEY_ENV}) only checksums are verified, not MACs",
                  file=sys.stderr)
        index = make_index(args.index, store.fingerprint, namespace=store.namespace) if args.index else None
        store.attach_index(index)
        try:
            report = Scrubber(store, args.tmp_grace_s).run(dry_run=args.dry_run)
        finally:
            if index is not None:
                index.close()
        if args.json:
            print(json.dumps(report.as_dict()), file=out)
        else:
            print(row.format(report.namespace, report.checked, report.ok, report.removed, report.quarantined,
                             report.untouched, report.bytes_read, f"{report.seconds:.2f}"), file=out)
            _print_found(report, out)


def _print_found(report: ScrubReport, out: TextIO) -> None:
    if report.found:
        found = ", ".join(f"{reason} {report.found[reason]}" for reason in REASONS if reason in report.found)
        print(f"  {'would remove' if report.dry_run else 'found'}: {found}", file=out)


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
