"""Compiling JSON schemas in a child process, inside a time and memory budget.

xgrammar's compile time and memory grow steeply with a schema's size (a 2,000-property
schema took 19 s and 2.5 GB; 13,000 properties grew a replica to ~20 GB until the OOM
killer took the node's processes). Compiled in the engine's process, one such request
stalls every other one and can take the deployment down. Here a compile runs in one
long-lived child (started on first use: workers.processes, a fork of a server that has
imported xgrammar), and the parent waits
for at most `timeout_s` while the child's resident memory stays under `memory_bytes`;
past either, the child is killed (the next compile starts a fresh one) and the request
gets `CompileBudgetExceeded`. The result crosses back as xgrammar's serialized grammar.

    worker = CompileWorker(tokenizer_info_json, timeout_s=10.0, memory_bytes=2 << 30)
    grammar_json = worker.compile(schema_json)     # or raises CompileBudgetExceeded / ValueError
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time

from kvmesh.workers.processes import start_child

log = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0      # importing xgrammar (and torch) in the child; not the compile's budget
POLL_S = 0.01                # how often the parent checks the child's memory and the clock
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class CompileBudgetExceeded(Exception):
    """The compile ran past its time or memory budget (the message names which); it was stopped."""


class CompilePreempted(Exception):
    """The compile was stopped by `CompileWorker.preempt` to make room for another (its child is
    killed; the caller queues it again)."""


def _serve(conn, tokenizer_info_json: str) -> None:
    """The child: compile schemas sent on `conn` until it is closed (or None arrives)."""
    import xgrammar as xgr
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        kind, text = msg
        try:
            grammar = (compiler.compile_grammar(text) if kind == "ebnf"
                       else compiler.compile_json_schema(text, any_whitespace=False))
            conn.send(("ok", grammar.serialize_json()))
        except Exception as e:   # xgrammar raises RuntimeError / ValueError on an unusable schema
            conn.send(("error", f"{type(e).__name__}: {e}"))


def resident_bytes(pid: int) -> int:
    """A process's resident set size now (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class CompileWorker:
    """One child process compiling one schema at a time (calls from several threads queue;
    workers.sampling.compile_pool runs several). Thread-safe; close() from another thread stops
    a compile in progress (it raises RuntimeError)."""

    def __init__(self, tokenizer_info_json: str, timeout_s: float, memory_bytes: int):
        self._info, self.timeout_s, self.memory_bytes = tokenizer_info_json, timeout_s, memory_bytes
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None
        self._closed = False
        self._preempt = False   # set by preempt(): the compile in progress stops
        self.stopped = 0        # compiles killed for their budget (since construction)

    def start(self) -> None:
        """Start the child now (else the first compile does), so a compile waits for no import."""
        with self._lock:
            self._started()

    @property
    def alive(self) -> bool:
        """The child is up (racy: for stats)."""
        proc = self._proc
        return proc is not None and proc.is_alive()

    def compile(self, text: str, kind: str = "json_schema") -> str:
        """The serialized compiled grammar of `text`, a JSON schema or (kind "ebnf") an EBNF
        grammar. Raises ValueError (unusable) or CompileBudgetExceeded (stopped at the time or
        memory budget)."""
        with self._lock:
            conn = self._started()
            self._preempt = False
            conn.send((kind, text))
            status, payload = self._wait(conn, self.timeout_s, budget=True)
        if status == "error":
            raise ValueError(payload)
        return payload

    def _started(self):
        if self._closed:
            raise RuntimeError("the grammar compiler was closed")
        if self._proc is None or not self._proc.is_alive():
            parent, child = multiprocessing.Pipe()
            # never a fork of this process (it has threads): workers.processes forks its server
            self._proc = start_child(_serve, (child, self._info), "kvmesh-grammar")
            child.close()
            self._conn = parent
            self._wait(parent, START_TIMEOUT_S, budget=False)
        return self._conn

    def _wait(self, conn, timeout_s: float, budget: bool) -> tuple[str, str]:
        deadline = time.monotonic() + timeout_s
        while not conn.poll(POLL_S):
            over = None
            if budget and resident_bytes(self._proc.pid) > self.memory_bytes:
                over = f"memory budget of {self.memory_bytes >> 20} MiB"
            elif time.monotonic() > deadline:
                over = f"time budget of {timeout_s:g} s"
            elif not self._proc.is_alive():
                over = "budget: the compiler process died"
            elif self._closed:
                over = "the grammar compiler was closed"
            elif budget and self._preempt:
                self._stop()
                raise CompilePreempted("stopped to make room for a shorter compile")
            if over is not None:
                self._stop()
                if self._closed:
                    raise RuntimeError(over)
                if not budget:
                    raise RuntimeError(f"the grammar compiler process did not start: {over}")
                self.stopped += 1
                raise CompileBudgetExceeded(over)
        try:
            return conn.recv()
        except EOFError:
            self._stop()
            raise CompileBudgetExceeded("budget: the compiler process died") from None

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def preempt(self) -> None:
        """Stop the compile in progress (from another thread): it raises CompilePreempted and the
        child is killed (the next compile starts a fresh one); no effect between compiles."""
        self._preempt = True

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._stop()
