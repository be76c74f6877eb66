"""The store scrub: check every object of one namespace, the never-read ones too, and clean up.

A read verifies what it reads (kvstore.store.object_store), but an object no request asks for is never read:
a corrupt one, a FIFO, a directory or a symlink at an object's name, a crashed writer's temp
file would stay forever. A pass walks the namespace's root (temp files only), `block/` and
`checkpoint/` without following a symlink or opening anything but a regular file (never a
FIFO, never blocking), and for each name:

| what is there                                              | found as        | then (not dry-run) |
| --- | --- | --- |
| an object that verifies (size, checksum, header, MAC)      | ok              | left alone         |
| a symlink, FIFO, socket, device or directory               | not_regular     | removed (a link, not its target) |
| a zero-byte object                                         | empty           | removed            |
| wrong size, bad checksum, unparseable header, another hash | corrupt         | removed            |
| no MAC, or one the store key does not verify               | unauthenticated | removed            |
| an I/O error; a read past the store's read timeout         | unreadable      | removed; a hung one quarantined (and the pass stops) |
| a `write_atomic` temp file older than the grace period     | stale_tmp       | removed            |
| a name that is not the store's, a quarantined object       | (untouched)     | left alone         |

Removal is `ObjectStore.reject`'s: unpublished from the attached index, and quarantined when it
cannot be removed. Only the store's own namespace directory is walked, so other namespaces (other
fingerprints, other store keys) are never touched; a store opened without the namespace's key
(`kvmesh store scrub` without it) checks checksums, not MACs.

A pass may have a budget (bytes read, seconds); a budgeted pass stops before the object that
would go over it and the next resumes there (`Scrubber` keeps the place), so the background
scrub (`ScrubSchedule`, run between puts on the write-behind thread) covers a big namespace over
several passes without hogging the store's IO.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import threading
import time
from dataclasses import dataclass, field

from kvmesh.kvstore.hashing import parse_hash_hex
from kvmesh.kvstore.log_once import LogOnce
from kvmesh.kvstore.store.objects import KINDS, CorruptObjectError, UnauthenticatedObjectError
from kvmesh.kvstore.store.object_store import OBJECT_RE, ObjectStore
from kvmesh.kvstore.store.store_fs import STALE_TMP_S, TMP_RE, Entry, NotAFileError, is_stale_tmp, list_entries
from kvmesh.kvstore.timed_io import TimedRunner

log = logging.getLogger(__name__)
REASONS = ("not_regular", "empty", "corrupt", "unauthenticated", "unreadable", "stale_tmp")
PASS_MAX_S = 5.0    # a background pass holds the write-behind thread at most this long (+ one read)
_WHERE = ("", *KINDS)   # the namespace root (temp files only), then one directory per kind


@dataclass
class ScrubReport:
    """One pass over one namespace. `found`: what failed, by reason (REASONS); each failure is
    then `removed` or `quarantined` (neither on a dry run)."""
    namespace: str
    dry_run: bool = False
    checked: int = 0            # objects read or inspected, plus stale temp files
    ok: int = 0
    removed: int = 0
    quarantined: int = 0
    found: dict[str, int] = field(default_factory=dict)
    untouched: int = 0          # other names in block/ and checkpoint/, quarantined objects, young temps
    bytes_read: int = 0
    seconds: float = 0.0
    complete: bool = True       # False: stopped by its budget (the next pass resumes)

    @property
    def clean(self) -> bool:
        return not self.found

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "clean": self.clean}


class Scrubber:
    """Scrub passes over `store`'s namespace. Not thread-safe: one pass at a time.

    `tmp_grace_s`: a temp file younger than this may be a live write and is left alone."""

    def __init__(self, store: ObjectStore, tmp_grace_s: float = STALE_TMP_S):
        self.store, self.tmp_grace_s = store, tmp_grace_s
        self._reader = TimedRunner(store.read_timeout_s, "kvmesh-store-scrub")    # not the serving reads'
        self._after: tuple[str, str] = ("", "")     # resume past this (directory, name)

    def run(self, dry_run: bool = False, max_bytes: int | None = None, max_s: float | None = None,
            stop: threading.Event | None = None) -> ScrubReport:
        """One pass from where the last budgeted one stopped to the end of the namespace, or
        until `max_bytes` read, `max_s` spent or `stop` set. Counted in the store's stats
        unless `dry_run` (which only reports)."""
        t0 = time.monotonic()
        deadline = None if max_s is None else t0 + max_s
        report = ScrubReport(self.store.namespace, dry_run)
        for where, entry in self._walk():
            if _spent(report, entry, max_bytes, deadline, stop) or not self._one(where, entry, report):
                report.complete = False
                break
            self._after = (where, entry.name)
        if report.complete:
            self._after = ("", "")
        report.seconds = time.monotonic() - t0
        if not dry_run:
            self.store.record_scrub(report.ok, report.removed, report.quarantined, report.seconds)
        return report

    def _walk(self):
        for where in _WHERE:
            directory = f"{self.store.directory}/{where}".rstrip("/")
            for entry in list_entries(self.store.filesystem, directory):
                if (where, entry.name) > self._after:
                    yield where, entry

    def _one(self, where: str, entry: Entry, report: ScrubReport) -> bool:
        """Scrub one name; False when the pass must stop (the store hung)."""
        if TMP_RE.match(entry.name):
            return self._temp(where, entry, report)
        if not where:               # the root's own files (FINGERPRINT, QUARANTINE, the kind directories)
            return True
        match = OBJECT_RE.match(entry.name)
        h = parse_hash_hex(match.group(1)) if match else None
        if h is None or self.store.is_quarantined(where, h):
            report.untouched += 1
            return True
        error, reason = self._check(where, h, entry, report)
        if reason is None:          # vanished since the listing (evicted, replaced): nothing to do
            return True
        report.checked += 1
        if error is None:
            report.ok += 1
            return True
        report.found[reason] = report.found.get(reason, 0) + 1
        if not report.dry_run:
            removed = self.store.reject(where, h, error)
            report.removed += removed
            report.quarantined += not removed
        return not isinstance(error, TimeoutError)

    def _check(self, kind: str, h: int, entry: Entry, report: ScrubReport
               ) -> tuple[BaseException | None, str | None]:
        """(what is wrong or None, its reason; "ok" when sound, None when it vanished)."""
        if entry.type != "file":
            return NotAFileError(errno.EINVAL, f"a {entry.type} where an object should be", entry.name), "not_regular"
        if entry.size == 0:
            return CorruptObjectError("empty: 0 bytes"), "empty"
        report.bytes_read += entry.size         # read whether it verifies or not
        try:
            self.store.verify(kind, h, self._reader.run)
        except FileNotFoundError:
            return None, None
        except UnauthenticatedObjectError as e:
            return e, "unauthenticated"
        except CorruptObjectError as e:
            return e, "corrupt"
        except OSError as e:        # an I/O error, a hung read (IoTimeoutError), a symlink since listed
            return e, "unreadable"
        return None, "ok"

    def _temp(self, where: str, entry: Entry, report: ScrubReport) -> bool:
        if not is_stale_tmp(entry, self.tmp_grace_s):
            report.untouched += 1
            return True
        report.checked += 1
        report.found["stale_tmp"] = report.found.get("stale_tmp", 0) + 1
        if report.dry_run:
            return True
        path = "/".join(p for p in (self.store.directory, where, entry.name) if p)
        try:
            self.store.filesystem.delete_file(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot remove stale temp file %s: %s", path, e)
            return True
        report.removed += 1
        return True


def _spent(report: ScrubReport, entry: Entry, max_bytes: int | None, deadline: float | None,
           stop: threading.Event | None) -> bool:
    """Whether the pass must stop before `entry` (it always gets through one object)."""
    size = entry.size if entry.type == "file" else 0
    over = max_bytes is not None and report.checked > 0 and report.bytes_read + size > max_bytes
    return over or (deadline is not None and time.monotonic() > deadline) or (stop is not None and stop.is_set())


class ScrubSchedule:
    """The background scrub: a pass of at most `pass_bytes` (and PASS_MAX_S) every `interval_s`,
    run by whoever owns the store's IO thread (`kvmesh.kvstore.store.persist.WriteBehind`, between puts)."""

    def __init__(self, scrubber: Scrubber, interval_s: float, pass_bytes: int | None):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0 (0 means no schedule), got {interval_s}")
        self.scrubber, self.interval_s, self.pass_bytes = scrubber, interval_s, pass_bytes
        self._next = time.monotonic() + interval_s
        self._warn = LogOnce(log)

    def wait_s(self) -> float:
        """Seconds until the next pass is due."""
        return max(0.0, self._next - time.monotonic())

    def run_if_due(self, stop: threading.Event | None = None) -> ScrubReport | None:
        """Run a pass when one is due; never raises (a failing pass is logged once per cause)."""
        if self.wait_s() > 0 or (stop is not None and stop.is_set()):
            return None
        try:
            report = self.scrubber.run(max_bytes=self.pass_bytes, max_s=PASS_MAX_S, stop=stop)
        except Exception as e:      # the store is an optimisation: a broken one must not stop the writer
            self._warn(type(e).__name__, "store scrub pass failed (%s: %s)", type(e).__name__, e)
            return None
        finally:
            self._next = time.monotonic() + self.interval_s
        if not report.clean:
            log.info("store scrub of %s: %s found, %d removed, %d quarantined", report.namespace, report.found,
                     report.removed, report.quarantined)
        return report
