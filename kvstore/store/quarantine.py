"""The object store's quarantine: objects no read may touch.

An unusable object (corrupt, forged, unreadable) is removed by the store. One that cannot be
removed is quarantined instead and listed in the namespace's QUARANTINE file, so no process
reads it again, this one after a restart included. One whose read hung is quarantined by this
process only: the mount may recover. Writing the object again, or removing it, lifts it.

    {root}/{ns}/QUARANTINE      "kind hash_hex" per line (kvstore.hashing.hash_hex)
"""
from __future__ import annotations

import threading

import pyarrow.fs as pafs

from kvmesh.kvstore.hashing import hash_hex, parse_hash_hex
from kvmesh.kvstore.log_once import LogOnce
from kvmesh.kvstore.store.objects import KINDS
from kvmesh.kvstore.store.store_fs import read_text, write_atomic

QUARANTINE_FILE = "QUARANTINE"


class Quarantine:
    """The quarantined (kind, hash) keys of one namespace directory `ns_dir`. Thread-safe.
    `warn`: the store's warn-once log, for a file that cannot be read or written (never raised:
    an object then is only read, and quarantined, once more)."""

    def __init__(self, fs: pafs.FileSystem, ns_dir: str, warn: LogOnce):
        self._fs, self._dir, self._warn = fs, ns_dir, warn
        self._path = f"{ns_dir}/{QUARANTINE_FILE}"
        self._lock = threading.Lock()
        self._persisted = self._read()                 # undeletable objects: in the file
        self._keys = set(self._persisted)              # ... and hung reads: this process only

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._keys

    def add(self, kind: str, h: int, persist: bool = False) -> bool:
        """Quarantine an object, for every process when `persist` (it could not be removed);
        True when it was not quarantined yet."""
        with self._lock:
            new = (kind, h) not in self._keys
            self._keys.add((kind, h))
            if persist:
                self._persisted.add((kind, h))
        if persist:
            self._write()
        return new

    def lift(self, kind: str, h: int) -> None:
        """The object was written again or removed: readable (or absent) like any other."""
        with self._lock:
            self._keys.discard((kind, h))
            persisted = (kind, h) in self._persisted
            self._persisted.discard((kind, h))
        if persisted:
            self._write()

    def _read(self) -> set[tuple[str, int]]:
        try:
            text = read_text(self._fs, self._path) or ""
        except OSError as e:     # unreadable: each object is read (and quarantined) once again
            self._warn("quarantine-list", "store quarantine list %s is unreadable (%s): ignored", self._path, e)
            return set()
        found = set()
        for line in text.splitlines():
            kind, _, hex_ = line.strip().partition(" ")
            try:
                found.add((kind, parse_hash_hex(hex_))) if kind in KINDS else None
            except ValueError:
                pass        # a damaged line only loses that entry (it is read, and quarantined, again)
        return found

    def _write(self) -> None:
        """Persist the quarantined objects that still exist (hung reads are this process's only)."""
        with self._lock:
            listed = sorted(self._persisted)
        text = "".join(f"{kind} {hash_hex(h)}\n" for kind, h in listed)
        try:
            write_atomic(self._fs, self._path, [text.encode()])
        except OSError as e:
            self._warn("quarantine-file", "cannot record the quarantine in %s (%s): other processes "
                       "will read those objects once each", self._dir, e)
