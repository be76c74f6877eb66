"""Filesystem primitives of the object store: URIs, atomic writes, mapped reads, listings.

Everything goes through `pyarrow.fs` so a store can live on a local or shared
mount (NVMe, NFS, 3FS, ...) or an object store (`s3://`, ...), except two
things only a local filesystem can do and that the store relies on there:
`fsync` + `rename` for durable atomic writes, and `mmap` for zero-copy reads.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import stat
import time
import uuid
from typing import NamedTuple, Sequence

import pyarrow.fs as pafs

from kvmesh.kvstore.hashing import NAMESPACE_RE

STALE_TMP_S = 3600.0  # a temp file older than this was left by a crashed writer
_TMP_SUFFIX = ".tmp"
TMP_RE = re.compile(r"^\.(?:[0-9a-f]{16}\.kv|FINGERPRINT|QUARANTINE)\.[0-9a-f]{32}\.tmp$")  # write_atomic's temps


def resolve_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    """A filesystem and root path for `uri`; a bare (even relative) path is local."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    filesystem, root = pafs.FileSystem.from_uri(uri)
    return filesystem, root.rstrip("/")


def is_local(filesystem: pafs.FileSystem) -> bool:
    return isinstance(filesystem, pafs.LocalFileSystem)


class NotAFileError(OSError):
    """A store path holds something other than a regular file (a directory, a FIFO, a device)."""


def read_text(filesystem: pafs.FileSystem, path: str) -> str | None:
    """A small text file's stripped contents (undecodable bytes replaced), or None if it
    does not exist. Other failures (a directory there, an I/O error) raise OSError."""
    try:
        if is_local(filesystem):
            with open_regular(path) as f:
                return f.read(1 << 16).decode(errors="replace").strip()
        with filesystem.open_input_stream(path) as f:
            return f.read().decode(errors="replace").strip()
    except FileNotFoundError:
        return None


def open_regular(path: str):
    """Open a local file for unbuffered reading, refusing anything but a regular file.
    O_NONBLOCK makes opening a FIFO return at once (it has no effect on regular files);
    O_NOFOLLOW refuses a symlink (ELOOP): the store never writes one, so one is not its object."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
            raise NotAFileError(errno.EINVAL, f"{kind} where an object should be", path)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def read_into(f, view: memoryview) -> int:
    """Read until `view` is full or EOF; returns the bytes read (short reads are retried)."""
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            break
        done += n
    return done


def list_namespace_dirs(uri: str, marker: str) -> dict[str, str | None]:
    """Namespace directory (kvstore.hashing.store_namespace) under the root -> contents of its
    `marker` file."""
    filesystem, root = resolve_uri(uri)
    found: dict[str, str | None] = {}
    for info in filesystem.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        if info.type == pafs.FileType.Directory and NAMESPACE_RE.match(info.base_name):
            try:
                found[info.base_name] = read_text(filesystem, f"{info.path}/{marker}")
            except OSError:     # a directory or an unreadable file where the marker should be
                found[info.base_name] = None
    return found


def write_atomic(filesystem: pafs.FileSystem, path: str, parts: Sequence[bytes | memoryview]) -> None:
    """Write `parts` so readers see either no file (or the old one) or all of it.

    Local: a hidden temp file in the same directory, fsync, then rename(2).
    Elsewhere: one output stream; object stores publish it only on close.
    """
    if not is_local(filesystem):
        with filesystem.open_output_stream(path) as out:
            for part in parts:
                out.write(part)
        return
    directory, name = path.rsplit("/", 1)
    tmp = f"{directory}/.{name}.{uuid.uuid4().hex}{_TMP_SUFFIX}"
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def read_whole(filesystem: pafs.FileSystem, path: str) -> mmap.mmap | bytearray:
    """The bytes of one file in a *writable* buffer; FileNotFoundError if absent.

    Local: a copy-on-write `mmap` (no copy; writes through tensors viewing it
    never reach the file) with readahead of the whole file. Elsewhere: one read
    into a bytearray.
    """
    if is_local(filesystem):
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return bytearray()  # mmap cannot map an empty file
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        if hasattr(mapped, "madvise"):
            mapped.madvise(mmap.MADV_WILLNEED)
        return mapped
    with filesystem.open_input_file(path) as f:
        buf = bytearray(f.size())
        done = f.readinto(buf)  # reads until full or EOF
    return buf if done == len(buf) else buf[:done]


def list_files(
    filesystem: pafs.FileSystem, directory: str, pattern: re.Pattern[str]
) -> list[tuple[re.Match[str], pafs.FileInfo]]:
    """Files in `directory` whose name matches `pattern` (a listing never changes anything:
    stale temp files are the scrub's, kvstore.store.scrub)."""
    found = []
    for info in filesystem.get_file_info(pafs.FileSelector(directory, allow_not_found=True)):
        if info.type == pafs.FileType.File and (match := pattern.match(info.base_name)):
            found.append((match, info))
    return found


class Entry(NamedTuple):
    """One name in a directory, as lstat(2) sees it: `type` is "file", "directory", "symlink",
    "fifo", "socket", "device" or "unknown" (what an object store cannot say)."""
    name: str
    type: str
    size: int
    mtime: float | None


_TYPES = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "fifo"),
          (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "device"), (stat.S_ISBLK, "device"))
_ARROW_TYPES = {pafs.FileType.File: "file", pafs.FileType.Directory: "directory"}


def list_entries(filesystem: pafs.FileSystem, directory: str) -> list[Entry]:
    """Every name in `directory`, sorted, without following a symlink or opening anything
    (locally: one lstat each; elsewhere: the object store's listing)."""
    if not is_local(filesystem):
        infos = filesystem.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
        return sorted(Entry(i.base_name, _ARROW_TYPES.get(i.type, "unknown"), i.size or 0,
                            i.mtime.timestamp() if i.mtime is not None else None) for i in infos)
    try:
        with os.scandir(directory) as it:
            found = []
            for e in it:
                with contextlib.suppress(FileNotFoundError):     # gone since the listing
                    st = e.stat(follow_symlinks=False)
                    kind = next((name for test, name in _TYPES if test(st.st_mode)), "unknown")
                    found.append(Entry(e.name, kind, st.st_size, st.st_mtime))
    except FileNotFoundError:
        return []
    return sorted(found)


def is_stale_tmp(entry: Entry, grace_s: float = STALE_TMP_S, now: float | None = None) -> bool:
    """A temp file of `write_atomic` older than `grace_s`: its writer crashed (a live write
    renames it within seconds)."""
    now = time.time() if now is None else now
    return (bool(TMP_RE.match(entry.name)) and entry.type not in ("directory", "unknown")
            and entry.mtime is not None and now - entry.mtime > grace_s)
