"""Store reads through NIXL's POSIX backend (issue 45 item 4): a restore's block objects, local
files of one size, READ by NIXL straight into the rows of a registered host buffer, in chunks
posted at once (many reads in flight), instead of one `readinto` after another.

    reader = NixlFileReader()                       # NixlUnavailable if NIXL or its POSIX plugin is missing
    reader.read(files, rows, on_chunk=lambda start, stop: ...)   # rows: a [n, size] uint8 tensor

Only the transport changes: the bytes land where `ObjectStore.get_rows`' own reads put them, and
the store verifies them the same way (checksum, MAC, header), so a short, torn or corrupt file is
the same miss it always was. A file that cannot be opened as a regular one of the expected size,
and a chunk whose transfer fails, are reported per object and read again the plain way by the
caller (`ObjectStore.get_rows`); a transfer that hangs is bounded by the store's read timeout like
any other read. The agent is one per process (no progress thread, no listener: nothing remote
talks to it), shared by every store under a lock. On a GPU the same agent could READ into device
memory with GDS / GDS_MT; this machine has none, so only POSIX is wired.
"""
from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    import torch

READERS = ("auto", "nixl", "file")     # ObjectStore's `reader`, EngineConfig.store_reader (this module loads light)
CHUNK_OBJECTS = 8          # objects per posted transfer: the caller verifies a chunk while later ones are read
POLL_S = 0.00005           # between polls of a transfer in flight (the backend completes in its own calls)

_lock = threading.Lock()
_reader: "NixlFileReader | None" = None
_failure: str | None = None


def shared_reader() -> "NixlFileReader":
    """The process's reader, made on first use; NixlUnavailable (remembered) if it cannot be."""
    global _reader, _failure
    from kvmesh.kvstore.transfer.nixl_transfer import NixlUnavailable
    with _lock:
        if _reader is None and _failure is None:
            try:
                _reader = NixlFileReader()
            except NixlUnavailable as e:
                _failure = str(e)
        if _reader is None:
            raise NixlUnavailable(_failure)
        return _reader


class NixlFileReader:
    def __init__(self, name: str | None = None):
        from kvmesh.kvstore.transfer.nixl_transfer import NixlUnavailable
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except Exception as e:      # ImportError, or a missing shared library
            raise NixlUnavailable(f"nixl cannot be imported: {e}") from e
        self.name = name or f"kvmesh-store-{os.getpid()}-{id(self):x}"
        try:
            self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["POSIX"]))
        except Exception as e:
            raise NixlUnavailable(f"nixl agent with the POSIX backend failed to start: {e}") from e
        if "POSIX" not in self._agent.backends:
            raise NixlUnavailable("nixl has no POSIX backend plugin here")
        self._lock = threading.Lock()
        self._hung: list = []           # buffers of abandoned reads, never freed while NIXL may write them

    def read(self, files: Sequence[int | None], rows: "torch.Tensor", on_chunk: Callable[[int, int, bool], None],
             abandoned: threading.Event | None = None) -> None:
        """READ each open file descriptor of `files` (None: skip that row) whole into its row of
        `rows` ([n, size] uint8, contiguous, host memory). Calls `on_chunk(start, stop, ok)` in
        order as each chunk of rows is done; `ok` False: that chunk's transfer failed and its
        rows hold nothing usable. Returns early, leaving the rest uncalled, once `abandoned` is set."""
        n, size = rows.shape
        base = rows.data_ptr()
        handles: list[tuple[int, int, object | None]] = []
        regs: list = []       # the rows and the files are the agent's (DRAM and FILE segments) while they are read
        with self._lock:
            try:
                opened = [fd for fd in files if fd is not None]
                if opened:
                    regs.append(self._agent.register_memory([(base, n * size, 0, "")], "DRAM"))
                    regs.append(self._agent.register_memory([(0, size, fd, "") for fd in opened], "FILE"))
            except Exception:
                files = [None] * n          # none can be READ: every row falls back
            for start in range(0, n, CHUNK_OBJECTS):
                stop = min(n, start + CHUNK_OBJECTS)
                picked = [i for i in range(start, stop) if files[i] is not None]
                handle = None
                if picked:
                    try:
                        local = self._agent.get_xfer_descs([(base + i * size, size, 0) for i in picked], "DRAM")
                        remote = self._agent.get_xfer_descs([(0, size, files[i]) for i in picked], "FILE")
                        handle = self._agent.initialize_xfer("READ", local, remote, self.name)
                        if self._agent.transfer(handle) == "ERR":
                            self._agent.release_xfer_handle(handle)
                            handle = False
                    except Exception:
                        handle = False
                handles.append((start, stop, handle))
        try:
            for start, stop, handle in handles:
                ok = handle is not False
                while ok and handle is not None:
                    if abandoned is not None and abandoned.is_set():
                        with self._lock:     # a hung read may still write: its buffer and handles live on
                            self._hung.append((rows, handles, regs))
                        regs = []
                        return
                    with self._lock:
                        state = self._agent.check_xfer_state(handle)
                    if state == "DONE":
                        break
                    if state == "ERR":
                        ok = False
                        break
                    time.sleep(POLL_S)
                if handle not in (None, False):
                    with self._lock:
                        self._agent.release_xfer_handle(handle)
                on_chunk(start, stop, ok)
        finally:
            with self._lock:
                for reg in regs:
                    self._agent.deregister_memory(reg)
