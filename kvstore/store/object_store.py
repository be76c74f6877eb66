"""The shared object store: block and checkpoint objects on any pyarrow filesystem.

Layout under the store root (a local path, ``file://``, ``s3://``, ...)::

    {root}/{ns}/FINGERPRINT              the full fingerprint (claims the namespace)
    {root}/{ns}/QUARANTINE               unusable objects that could not be removed, one per line
    {root}/{ns}/block/{hash_hex}.kv       one object per block
    {root}/{ns}/checkpoint/{hash_hex}.kv  one object per checkpoint

    ns = fingerprint[:16]                 without a store key
    ns = {fingerprint[:16]}-k{key_id}     with one (kvstore.hashing.store_namespace)

Objects are in the format of :mod:`kvmesh.kvstore.store.objects`; filesystem primitives live
in :mod:`kvmesh.kvstore.store.store_fs`. The store is the truth and
the index a hint (DESIGN §4):

* ``put`` is atomic (local: temp file + fsync + rename; object stores: one
  output stream, visible only when closed) and publishes to the attached index
  (and, for a block, to the attached KV event publisher as the store tier) only
  once the object is durable; every removal unpublishes the same way.
* ``get`` verifies every object (local: one copy-on-write ``mmap``, zero-copy);
  a corrupt, truncated or foreign one is deleted, unpublished, counted and
  served as a miss. It never returns wrong data, and never raises or hangs for
  what it finds: an I/O error, a directory or FIFO at an object's path, a read
  past ``read_timeout_s`` are misses too, logged once per cause with the
  object's name. Each is removed once (a directory at an object's path too), so
  the prefix can be stored again. An object that cannot be removed is
  quarantined (:mod:`kvmesh.kvstore.store.quarantine`): listed in the namespace's QUARANTINE
  file, so no process reads it again, this one after a restart included (a hung
  read is quarantined by this process only: the mount may recover).
* With a ``key`` (kvstore.store.mac) objects carry a MAC and only those it verifies
  are used; without one the store trusts whoever can write to it (said once).
  Each key has its own namespace, so a node with a wrong key never reads, removes
  or overwrites the objects of another key (or the unkeyed ones).
* A scrub (:mod:`kvmesh.kvstore.store.scrub`; `kvmesh store scrub`, and a budgeted background pass in a
  serving engine) reads every object of the namespace, the never-read ones too, and rejects
  what fails as ``get`` would; it also removes what no read ever meets (a symlink, a FIFO, a
  directory at an object's path, a crashed writer's temp file). Names it does not know, and
  other namespaces, are never touched.
* Capacity is per fingerprint namespace. A put that goes over it evicts (and
  unpublishes) the least recently used objects: this process's reads and
  writes, seeded from file mtimes. A put never fails for space; an object
  larger than the whole capacity is skipped.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from typing import NamedTuple, Sequence

import pyarrow.fs as pafs
import torch

from kvmesh.kvstore.hashing import (FINGERPRINT_MIN_CHARS, NAMESPACE_RE, check_fingerprint, hash_hex, parse_hash_hex,
                             store_namespace)
from kvmesh.kvstore.index.embedded import PrefixIndex
from kvmesh.kvstore.index.kv_events import KvEventPublisher
from kvmesh.kvstore.log_once import LogOnce
from kvmesh.kvstore.store.mac import StoreKey
from kvmesh.kvstore.store.nixl_reader import READERS
from kvmesh.kvstore.store.objects import KINDS, CacheObject, CorruptObjectError, decode_object, encode_object_parts
from kvmesh.kvstore.store.quarantine import QUARANTINE_FILE, Quarantine
from kvmesh.kvstore.store.read_buffers import ReadBuffers
from kvmesh.kvstore.store.store_fs import (is_local, list_files, list_namespace_dirs, open_regular, read_into, read_text,
                              read_whole, resolve_uri, write_atomic)
from kvmesh.kvstore.store.tiers import CacheTier, RowTensors, Shapes, shapes_of
from kvmesh.kvstore.timed_io import DEFAULT_READ_TIMEOUT_S, IoTimeoutError, TimedRunner

log = logging.getLogger(__name__)

OBJECT_SUFFIX = ".kv"
FINGERPRINT_FILE = "FINGERPRINT"
OBJECT_RE = re.compile(r"^([0-9a-f]{16})\.kv$")
_FINGERPRINT_RE = re.compile(r"^[0-9a-f]{%d,}$" % FINGERPRINT_MIN_CHARS)
_trust_warned = False


class StoreUnavailableError(RuntimeError):
    """The store cannot be opened (its root or namespace is unusable); the message says why."""


class StoreStats(NamedTuple):
    """Counts for one namespace: objects/bytes as of the last scan plus this
    process's writes; the counters are this process's since construction."""

    objects: dict[str, int]
    bytes: dict[str, int]
    total_bytes: int
    capacity_bytes: int | None
    reads: int
    writes: int
    bytes_read: int
    bytes_written: int
    misses: int
    corrupt: int
    evicted: int
    skipped: int
    read_errors: int = 0      # I/O errors, wrong file types, timeouts
    timeouts: int = 0
    quarantined: int = 0      # unusable objects that could not be removed
    scrub_ok: int = 0         # scrubbed objects (kvstore.store.scrub) found sound ...
    scrub_removed: int = 0    # ... found unusable and removed (stale temp files too) ...
    scrub_quarantined: int = 0  # ... or quarantined (not removable, or a hung read)
    scrub_passes: int = 0
    scrub_last_pass_s: float = 0.0


class _Entry(NamedTuple):
    size: int
    atime: float  # wall-clock seconds of the last read/write we know of
    read: bool = False  # read since written (by this process)


def list_namespaces(uri: str) -> dict[str, str | None]:
    """Namespace directory name -> full fingerprint (None if it was never claimed)."""
    return list_namespace_dirs(uri, FINGERPRINT_FILE)


def warn_unkeyed(uri: str) -> None:
    """Say (once per process) that the store at `uri` is used without a key. Only where that is
    true: a serving store opened without one, or `kvmesh store` without $KVMESH_STORE_KEY over
    namespaces written without one (cluster/cli/store.py)."""
    global _trust_warned
    if not _trust_warned:
        _trust_warned = True
        log.warning("store %s has no key (KVMESH_STORE_KEY / engine.store_key): objects are checksummed, "
                    "not authenticated; anyone who can write to it controls outputs for its prefixes", uri)


def _local_size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def _namespace_of(fingerprint: str, key: StoreKey | None, namespace: str | None) -> str:
    own = store_namespace(fingerprint, key.key_id if key is not None else None)
    if namespace is None or namespace == own:
        return own
    if key is not None or not NAMESPACE_RE.match(namespace) or not namespace.startswith(own):
        raise ValueError(f"namespace {namespace!r} is not one of fingerprint {fingerprint[:16]}"
                         + (f" under this store key (that is {own!r})" if key is not None else ""))
    return namespace


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"object kind must be one of {KINDS}, got {kind!r}")


class ObjectStore(CacheTier):
    """Block and checkpoint objects of one model fingerprint. Thread-safe.

    Wiring with an index that is rebuilt from the store it serves::

        store = ObjectStore(uri, fp, capacity_bytes)
        store.attach_index(make_index(spec, fp, store))
    """

    def __init__(
        self,
        uri: str,
        fingerprint: str,
        capacity_bytes: int | None = None,
        index: PrefixIndex | None = None,
        evict_unread_first: bool = False,
        key: StoreKey | None = None,
        read_timeout_s: float | None = DEFAULT_READ_TIMEOUT_S,
        staging_bytes: int = 0,
        namespace: str | None = None,
        reader: str = "file",
        reads_in_flight: int = 1,
        read_buffer_bytes: int = 0,
    ) -> None:
        """``namespace``: open this namespace directory (a name `list_namespaces` gave) instead
        of the one that ``fingerprint`` and ``key`` name, for tools that list and trim a
        namespace without holding its key (`kvmesh store`). ``reader``: how a restore reads
        block objects: "file" (this process's reads: os reads on a local folder, pyarrow.fs
        elsewhere), "nixl" (NIXL's POSIX backend, kvstore.store.nixl_reader; a local folder
        only, and StoreUnavailableError if NIXL cannot load) or "auto" (NIXL where it loads
        and the store is a local folder, else "file"). ``reads_in_flight``: `get_many` calls that
        may read at once (each from its own thread; the rest wait). ``read_buffer_bytes``: freed buffers
        of `get_many(own=True)` kept to be read into again (kvstore.store.read_buffers), so a
        prefetch does not fault fresh memory in page by page."""
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive or None, got {capacity_bytes}")
        self._fingerprint = check_fingerprint(fingerprint)
        self._capacity = capacity_bytes
        self._unread_first = evict_unread_first  # objects never read since written go first
        self._fs, root = resolve_uri(uri)
        self._namespace = _namespace_of(self._fingerprint, key, namespace)
        self._dir = f"{root}/{self._namespace}"
        self._index: PrefixIndex | None = None
        self._events: KvEventPublisher | None = None
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()  # LRU first
        self._bytes = 0
        self._counters = dict.fromkeys(
            ("reads", "writes", "bytes_read", "bytes_written", "misses", "corrupt", "evicted", "skipped",
             "read_errors", "timeouts", "quarantined", "scrub_ok", "scrub_removed", "scrub_quarantined",
             "scrub_passes", "scrub_last_pass_s"), 0
        )
        self._key = key
        self._reader = TimedRunner(read_timeout_s, "kvmesh-store-read", parallel=reads_in_flight)
        self._warn = LogOnce(log)        # each cause once: a store full of bad objects cannot flood the log
        # get_many reads blocks into this reused buffer; touched once now so a restore never
        # page-faults its way through fresh memory.
        self._staging = torch.zeros(staging_bytes, dtype=torch.uint8)
        self._buffers = ReadBuffers(read_buffer_bytes)
        self._nixl = self._open_reader(reader, uri)
        try:
            for kind in KINDS:  # hierarchical filesystems need them; object stores shrug
                self._fs.create_dir(f"{self._dir}/{kind}", recursive=True)
            self._claim_namespace()
            self._quarantine = Quarantine(self._fs, self._dir, self._warn)
        except OSError as e:
            raise StoreUnavailableError(f"store {uri}: cannot use {self._dir}: {e}") from e
        if namespace is None:       # serving, not a tool listing or trimming a namespace (`kvmesh store`)
            self._say_trust(uri)
        if index is not None:
            self.attach_index(index)
        self._scan()

    def _open_reader(self, reader: str, uri: str):
        if reader not in READERS:
            raise ValueError(f"reader must be one of {READERS}, got {reader!r}")
        if reader == "file" or (reader == "auto" and not is_local(self._fs)):
            return None
        if not is_local(self._fs):
            raise StoreUnavailableError(f"store {uri}: the nixl reader reads local files; this store is not a "
                                        "local folder (use reader auto or file)")
        from kvmesh.kvstore.store.nixl_reader import shared_reader
        from kvmesh.kvstore.transfer.nixl_transfer import NixlUnavailable
        try:
            return shared_reader()
        except NixlUnavailable as e:
            if reader == "nixl":
                raise StoreUnavailableError(f"store {uri}: the nixl reader is unavailable: {e}") from e
            self._warn("nixl-reader", "store reads: NIXL's POSIX backend is unavailable (%s); reading with "
                       "this process's own reads", e)
            return None

    @property
    def reader(self) -> str:
        """How block objects are read: "nixl" or "file"."""
        return "file" if self._nixl is None else "nixl"

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def namespace(self) -> str:
        """The namespace directory's name: the index of this store must use the same."""
        return self._namespace

    @property
    def capacity_bytes(self) -> int | None:
        return self._capacity

    @property
    def directory(self) -> str:
        """The namespace directory (on `filesystem`)."""
        return self._dir

    @property
    def filesystem(self) -> pafs.FileSystem:
        return self._fs

    @property
    def read_timeout_s(self) -> float | None:
        return self._reader.timeout_s

    def attach_index(self, index: PrefixIndex | None) -> None:
        """Publish future puts to (and unpublish evictions from) ``index``."""
        if index is not None and (index.fingerprint, index.namespace) != (self._fingerprint, self._namespace):
            raise ValueError(
                f"index namespace {index.namespace} (fingerprint {index.fingerprint[:16]}) does not match "
                f"store namespace {self._namespace}"
            )
        self._index = index

    def attach_events(self, events: KvEventPublisher | None) -> None:
        """Push this process's block puts and removals to ``events`` as the store tier (routing:
        kvstore/index/kv_events.py), next to what the index is told."""
        self._events = events

    def _say_trust(self, uri: str) -> None:
        if self._key is None:
            warn_unkeyed(uri)

    def _claim_namespace(self) -> None:
        path = f"{self._dir}/{FINGERPRINT_FILE}"
        owner = read_text(self._fs, path)
        if owner is not None and not _FINGERPRINT_RE.match(owner):
            log.warning("store namespace marker %s is corrupt (%r): rewritten", path, owner[:40])
            owner = None
        if owner is None:
            write_atomic(self._fs, path, [self._fingerprint.encode()])
        elif owner != self._fingerprint:
            raise ValueError(
                f"store namespace {self._dir} belongs to fingerprint {owner}, not {self._fingerprint}"
            )

    def _path(self, kind: str, h: int) -> str:
        return f"{self._dir}/{kind}/{hash_hex(h)}{OBJECT_SUFFIX}"

    # -- writing -----------------------------------------------------------------

    def put(
        self, kind: str, h: int, parent: int | None, token_count: int, tensors: dict[str, torch.Tensor]
    ) -> int:
        """Store one object atomically, publish it, evict to capacity; return bytes written.

        Returns 0 (and logs) when the object alone exceeds the capacity.
        Re-putting an existing hash replaces the object.
        """
        _check_kind(kind)
        parts = encode_object_parts(self._fingerprint, kind, h, parent, token_count, tensors, self._key)
        size = sum(memoryview(p).nbytes for p in parts)
        if self._capacity is not None and size > self._capacity:
            log.warning(
                "not storing %s %s: %d bytes exceed the store capacity of %d bytes",
                kind, hash_hex(h), size, self._capacity,
            )
            self._track(kind, h, None, skipped=1)
            return 0
        write_atomic(self._fs, self._path(kind, h), parts)
        if (kind, h) in self._quarantine:       # replaced after all: usable again
            self._quarantine.lift(kind, h)
        self._track(kind, h, size, writes=1, bytes_written=size)
        self._update_index(kind, h, present=True)
        if self._capacity is not None:
            self._evict_to(self._capacity)
        return size

    # -- reading -----------------------------------------------------------------

    def get(self, kind: str, h: int, lazy: bool = False) -> CacheObject | None:
        """The verified object, or None for a missing or unusable one (then removed).
        ``lazy``: return the verified bytes and tensor table instead of tensor views."""
        _check_kind(kind)
        path = self._path(kind, h)
        if (kind, h) in self._quarantine:
            self._track(kind, h, None, misses=1)
            return None
        try:
            buf = self._reader.run(lambda: read_whole(self._fs, path))
            obj = decode_object(buf, self._fingerprint, h, kind, lazy=lazy, key=self._key)
        except FileNotFoundError:
            self._track(kind, h, None, misses=1)
            return None
        except (OSError, CorruptObjectError) as e:
            self.reject(kind, h, e)
            return None
        self._track(kind, h, len(buf), reads=1, bytes_read=len(buf))
        return obj

    def verify(self, kind: str, h: int, run=None) -> int:
        """Read and verify one object as `get` does, but as a check: not counted as a read and
        not moved in the LRU (the scrub's). Returns its size; raises what `get` serves as a miss
        (FileNotFoundError, OSError, IoTimeoutError, CorruptObjectError). `run`: the timed runner
        to read on (default: the store's, shared with `get`)."""
        _check_kind(kind)
        buf = (run or self._reader.run)(lambda: read_whole(self._fs, self._path(kind, h)))
        decode_object(buf, self._fingerprint, h, kind, lazy=True, key=self._key)
        return len(buf)

    def get_rows(self, kind: str, hashes: Sequence[int], staging: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor | None, list[CacheObject | None]]:
        """Read many same-sized objects straight into the rows of one uint8 tensor (inside
        `staging`, a reused flat uint8 buffer, when it is big enough).

        Returns (rows [n, size] or None, lazily decoded objects viewing those rows); an
        object that is missing or unusable is None (and removed, as in `get`).
        One read per object into its row: no mapping, no intermediate copy. When the
        objects are not all local files of one size, falls back to `get(lazy=True)`.
        Raises IoTimeoutError when a read hangs past the timeout: the hung read may
        still write into `staging` later, so the caller must stop using that buffer.
        """
        _check_kind(kind)
        paths = [self._path(kind, h) for h in hashes]
        sizes = [_local_size(p) for p in paths] if is_local(self._fs) else [None]
        size = sizes[0]
        if size is None or any(x != size for x in sizes) or any(k in self._quarantine for k in
                                                                 ((kind, h) for h in hashes)):
            return None, [self.get(kind, h, lazy=True) for h in hashes]
        need = len(paths) * size
        if staging is not None and staging.numel() >= need:
            rows = staging[:need].view(len(paths), size)
        else:
            rows = self._buffers.take(need).view(len(paths), size)
        view = memoryview(rows.numpy()).cast("B")
        done = [0] * len(paths)
        errors: list[BaseException | None] = [None] * len(paths)
        objs: list[CacheObject | None] = [None] * len(paths)
        progress = [0]
        abandoned = threading.Event()

        def read_one(i: int) -> None:
            try:
                with open_regular(paths[i]) as f:
                    done[i] = read_into(f, view[i * size:(i + 1) * size])
            except OSError as e:
                errors[i] = e

        def verify(i: int) -> None:
            """Object i once its bytes are in (or its read failed): checked, counted, kept or rejected."""
            h = hashes[i]
            if abandoned.is_set():          # the caller gave up on this call (a hung read): nothing counts
                return
            try:
                if errors[i] is not None:
                    raise errors[i]
                objs[i] = decode_object(view[i * size:i * size + done[i]], self._fingerprint, h, kind,
                                        lazy=True, key=self._key)
            except FileNotFoundError:
                self._track(kind, h, None, misses=1)
            except (OSError, CorruptObjectError) as e:
                self.reject(kind, h, e)
            else:
                self._track(kind, h, size, reads=1, bytes_read=size)

        def read_nixl() -> None:
            """Open each file (a regular one, as read_one does) and let NIXL READ those of the
            expected size; the rest, and a chunk whose transfer failed, are read plainly. Each
            chunk is verified as it completes, while NIXL reads the later ones."""
            opened, fds = [], [None] * len(paths)
            try:
                for i, path in enumerate(paths):
                    try:
                        f = open_regular(path)
                    except OSError as e:
                        errors[i] = e
                        continue
                    opened.append(f)
                    if os.fstat(f.fileno()).st_size == size:
                        fds[i] = f.fileno()

                def on_chunk(start: int, stop: int, ok: bool) -> None:
                    for i in range(start, stop):
                        progress[0] = i
                        if fds[i] is not None and ok:
                            done[i] = size
                        elif errors[i] is None:
                            read_one(i)
                        verify(i)
                    progress[0] = min(stop, len(paths) - 1)     # a hang from here is the next chunk's
                self._nixl.read(fds, rows, on_chunk, abandoned)
            finally:
                for f in opened:
                    f.close()

        def read_all() -> None:
            """On the reader's worker: read and verify one object after the other (one thread: on
            two cores a verifier beside the reads only traded the GIL with them, 1.7x slower)."""
            if self._nixl is not None:
                return read_nixl()
            for i in range(len(paths)):
                if abandoned.is_set():
                    return
                progress[0] = i
                read_one(i)
                verify(i)

        try:
            self._reader.run(read_all)
        except IoTimeoutError as e:
            abandoned.set()
            self.reject(kind, hashes[progress[0]], e)
            raise
        return rows, objs

    def get_many(self, kind: str, hashes: Sequence[int], expect: Shapes | None = None, own: bool = False
                 ) -> list[RowTensors | dict[str, torch.Tensor] | None]:
        """The tier interface's read (kvstore.store.tiers). Blocks are read in one pass into the
        rows of one tensor (`RowTensors`, valid until the next get_many: they view a reused
        staging buffer; `own`: a buffer of their own instead, kept as long as they are, and
        safe from another thread); checkpoints are read whole. An object that does not fit
        `expect` is rejected (counted corrupt, removed). Raises IoTimeoutError when a read hangs
        (the staging buffer it may still write into is dropped first)."""
        if kind != "block":
            return [self._fitting(kind, h, self.get(kind, h), expect) for h in hashes]
        if not hashes:
            return []
        try:
            rows, objs = self.get_rows(kind, hashes, None if own else self._staging)
        except IoTimeoutError:
            if not own:
                self._staging = torch.zeros_like(self._staging)
            raise
        out = []
        for i, (h, obj) in enumerate(zip(hashes, objs)):
            if obj is not None:
                data = rows if rows is not None else torch.frombuffer(obj.data, dtype=torch.uint8)[None]
                start = obj.data_start if rows is not None else 0
                obj = RowTensors(data, i if rows is not None else 0, start, obj.table, len(obj.data))
            out.append(self._fitting(kind, h, obj, expect))
        return out

    def _fitting(self, kind: str, h: int, tensors, expect: Shapes | None):
        if isinstance(tensors, CacheObject):
            tensors = tensors.tensors
        if tensors is None or expect is None or shapes_of(tensors) == expect:
            return tensors
        self.reject(kind, h, CorruptObjectError("its tensors do not fit this cache layout (missing, extra or reshaped)"))
        return None

    def reject(self, kind: str, h: int, error: BaseException) -> bool:
        """An object that cannot be used (corrupt, forged, unreadable, of another layout):
        count it, log the cause once, unpublish it and remove it - or, when it cannot be
        removed, quarantine it so this process never reads it again. True when removed."""
        path = self._path(kind, h)
        corrupt = isinstance(error, CorruptObjectError) or not isinstance(error, (OSError, TimeoutError))
        timeout = isinstance(error, TimeoutError)
        self._track(kind, h, None, corrupt=int(corrupt), read_errors=int(not corrupt), timeouts=int(timeout))
        self._warn(type(error).__name__, "store object %s unusable (%s: %s): served as a miss",
                   path, type(error).__name__, error)
        if timeout:     # removing may hang the same way: only stop reading it
            self._quarantined(kind, h)
            self._update_index(kind, h, present=False)
            return False
        try:
            self.delete(kind, h)
        except OSError as e:
            self._quarantined(kind, h, persist=True)
            self._warn("undeletable", "cannot remove unusable store object %s (%s): quarantined "
                       "(%s), no process will read it again", path, e, QUARANTINE_FILE)
            return False
        return True

    def _quarantined(self, kind: str, h: int, persist: bool = False) -> None:
        if self._quarantine.add(kind, h, persist):
            with self._lock:
                self._counters["quarantined"] += 1

    def is_quarantined(self, kind: str, h: int) -> bool:
        return (kind, h) in self._quarantine

    def contains(self, kind: str, h: int) -> bool:
        """Whether an object file exists (not verified; ``get`` verifies)."""
        _check_kind(kind)
        return self._fs.get_file_info(self._path(kind, h)).type == pafs.FileType.File

    def list(self, kind: str) -> list[int]:
        """Hashes of every ``kind`` object in the store (a fresh listing), quarantined ones left out."""
        return [h for h, _ in self._list_files(kind)]

    def _list_files(self, kind: str) -> list[tuple[int, pafs.FileInfo]]:
        _check_kind(kind)
        files = list_files(self._fs, f"{self._dir}/{kind}", OBJECT_RE)
        listed = [(parse_hash_hex(match.group(1)), info) for match, info in files]
        return [(h, info) for h, info in listed if (kind, h) not in self._quarantine]

    # -- eviction ----------------------------------------------------------------

    def delete(self, kind: str, h: int) -> bool:
        """Unpublish and remove one object; return whether a file was removed."""
        _check_kind(kind)
        self._update_index(kind, h, present=False)
        self._track(kind, h, None)
        path = self._path(kind, h)
        try:
            if self._fs.get_file_info(path).type == pafs.FileType.Directory:
                self._fs.delete_dir(path)       # a directory where an object belongs: it blocks every put
            else:
                self._fs.delete_file(path)
        except FileNotFoundError:
            removed = False
        else:
            removed = True
        if (kind, h) in self._quarantine:
            self._quarantine.lift(kind, h)
        return removed

    def gc(self, target_bytes: int | None = None) -> int:
        """Rescan the store, then evict LRU objects until at most ``target_bytes``
        (default: the capacity; no capacity and no target: only rescan). Returns
        the number of objects evicted."""
        self._scan()
        target = self._capacity if target_bytes is None else target_bytes
        return 0 if target is None else self._evict_to(target)

    def _evict_to(self, target: int) -> int:
        victims = []
        with self._lock:
            order = list(self._entries.items()) if self._bytes > target else []
            if self._unread_first:
                order = [kv for kv in order if not kv[1].read] + [kv for kv in order if kv[1].read]
            for key, entry in order:
                if self._bytes <= target:
                    break
                del self._entries[key]
                self._bytes -= entry.size
                victims.append(key)
            self._counters["evicted"] += len(victims)
        for kind, h in victims:
            self._update_index(kind, h, present=False)  # first: no reader is sent to a vanishing file
            try:
                self._fs.delete_file(self._path(kind, h))
            except FileNotFoundError:
                pass
            except OSError as e:
                self._warn("evict", "cannot evict store object %s: %s", self._path(kind, h), e)
        if victims:
            log.info("evicted %d objects from %s to fit %d bytes", len(victims), self._dir, target)
        return len(victims)

    def _update_index(self, kind: str, h: int, present: bool) -> None:
        if self._events is not None and kind == "block":
            (self._events.stored if present else self._events.removed)("store", [h])
        if self._index is None:
            return
        if kind == "block":
            (self._index.publish_blocks if present else self._index.remove_blocks)([h])
        else:
            (self._index.publish_checkpoint if present else self._index.remove_checkpoint)(h)

    # -- bookkeeping -------------------------------------------------------------

    def _scan(self) -> None:
        """Rebuild the LRU map from a listing: known objects keep their access
        time, others are seeded from their mtime; vanished ones are dropped."""
        listed = {}
        for kind in KINDS:
            for h, info in self._list_files(kind):
                seen = info.mtime.timestamp() if info.mtime is not None else 0.0
                listed[(kind, h)] = _Entry(info.size or 0, seen)
        with self._lock:
            for key, entry in listed.items():
                if key in self._entries:
                    known = self._entries[key]
                    listed[key] = entry._replace(atime=known.atime, read=known.read)
            order = sorted(listed.items(), key=lambda item: item[1].atime)
            self._entries = OrderedDict(order)
            self._bytes = sum(entry.size for entry in self._entries.values())

    def _track(self, kind: str, h: int, size: int | None, **counts: int) -> None:
        """Mark ``(kind, h)`` most recently used with ``size`` bytes (None: forget
        it), and add ``counts`` to the counters."""
        with self._lock:
            old = self._entries.pop((kind, h), None)
            self._bytes -= old.size if old else 0
            if size is not None:
                read = counts.get("reads", 0) > 0 or (old is not None and old.read)
                self._entries[(kind, h)] = _Entry(size, time.time(), read)
                self._bytes += size
            for name, n in counts.items():
                self._counters[name] += n

    def record_scrub(self, ok: int, removed: int, quarantined: int, seconds: float) -> None:
        """Count one scrub pass (kvstore.store.scrub) in `stats`."""
        with self._lock:
            for name, n in (("scrub_ok", ok), ("scrub_removed", removed), ("scrub_quarantined", quarantined),
                            ("scrub_passes", 1)):
                self._counters[name] += n
            self._counters["scrub_last_pass_s"] = seconds

    def stats(self) -> StoreStats:
        with self._lock:
            objects, sizes = dict.fromkeys(KINDS, 0), dict.fromkeys(KINDS, 0)
            for (kind, _), entry in self._entries.items():
                objects[kind] += 1
                sizes[kind] += entry.size
            return StoreStats(objects, sizes, self._bytes, self._capacity, **self._counters)

    def __repr__(self) -> str:
        return f"ObjectStore({self._dir!r}, capacity_bytes={self._capacity})"
