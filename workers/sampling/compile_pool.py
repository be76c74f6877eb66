"""A pool of grammar compiler processes, so no request's grammar waits behind another's.

One compiler process compiles one grammar at a time, and xgrammar's compile time grows
steeply with a schema's size (the tiny checkpoints' byte tokenizer, a loaded 2-core box: 50
required properties 0.2 s, 200 in 2.4 s, 400 in 11 s), so behind one child a small schema waited for every large one queued before it
(issue 31: 50 s behind three). Here `size` children (grammar_worker.CompileWorker, each with its
own time and memory budget and kill-on-budget) compile side by side:

    pool = CompilePool(tokenizer_info, size=None, timeout_s=10.0, memory_bytes=2 << 30)   # None: default_size()
    future = pool.submit(schema_json, "json_schema")     # concurrent.futures.Future of the serialized grammar
    future.result()                                      # or ValueError / CompileBudgetExceeded

Which compile runs next: the cost of a compile is not known until it ends, so it is estimated
by its text's length (what it grows with). A text of LARGE_TEXT_BYTES or more is *large*; large
compiles may hold at most size - 1 children at once, so one child is always kept for small
ones, and queued small compiles go before queued large ones (first come, first served within
each). A small schema behind any number of large ones therefore waits only for the small
compiles queued before it, never for a large one. The alternatives were weaker: a queue ordered by cost
alone still lets large compiles take every child (a small one then waits up to a full time
budget), and cancelling a running compile to make room wastes the work already done. A small
text that is slow anyway (a short but pathological schema) holds the kept child only until its
own time budget. With size 1 nothing can be kept: compiles run one at a time in that order.

Among large compiles, shorter ones are not queued behind long ones either (issue 48: a 4 KB
schema that compiles in 1.4 s alone took 29 s behind ten slow 18 KB ones): a multi-level queue by
time already spent. Every compile first waits in the *fresh* level, shortest text first; a
compile that has run SLICE_S while a shorter fresh one waits for its child is stopped
(`CompileWorker.preempt`: its child is killed and restarted) and queued again in the *long*
level, which runs only when no fresh compile of its kind waits, first come first served. So a
mid-size schema behind any number of slow ones waits at most SLICE_S and a child's restart
before it runs, and a slow one costs its budget once more at most (it starts over; it is
stopped at most MAX_PREEMPTIONS times, so a stream of shorter ones cannot starve it). Size-order
alone was not enough: the slow ones already running would still hold every child for their
whole budget. The work a stopped compile had done is lost, which is the price: a paused child
(SIGSTOP) would keep its memory, up to the memory budget, for as long as it waits.

Between clients (issue 48: one client's 40 slow schemas held every child), compile time is
shared: a compile carries its client (the API key, else the address: cluster/openai/auth.py), and
a child takes a compile of the client with the fewest compiles running, among equals the one
that started one longest ago (round robin), and within a client in the order above (no child
idles while work waits). A client's *share* is the children divided among the clients with a
compile queued or running (rounded up); a compile of a client under its share that cannot
start stops, after its slice, the longest compile of a client over its share (the same
preemption, same bound). So behind any
number of one client's compiles another client's waits at most SLICE_S and a restart.

Children start with the pool, all at once and in the pool's threads (importing xgrammar takes
seconds; `tokenizer_info()`, xgrammar's serialized TokenizerInfo, is called there once, so
creating a pool never waits for an import: an engine may create it inside its step), and a
child killed for its budget is restarted right away, before it takes the next compile (the
restart counts in its compile's lane). Thread-safe.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple

from .grammar_worker import CompilePreempted, CompileWorker

log = logging.getLogger(__name__)
LARGE_TEXT_BYTES = 4 << 10     # byte tokenizer, loaded box: ~0.5-1 s at this size, 0.2 s at 2 KiB, ms below
SLICE_S = 1.0                  # a compile's time before a shorter fresh one waiting may stop it
MAX_PREEMPTIONS = 2            # times one compile may be stopped that way
MAX_DEFAULT_SIZE = 4           # children by default at most (each holds ~300 MiB once xgrammar is imported)


def default_size() -> int:
    """Children when the config names none: the CPUs this process may run on, at most MAX_DEFAULT_SIZE."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_SIZE, cpus))


class PoolStats(NamedTuple):
    processes: int       # children up now
    running: int         # compiles in a child now (or restarting it after a budget kill)
    queued: int          # compiles waiting for a child
    compiled: int        # compiles that ended (ok, unusable, or stopped) since start
    budget_kills: int    # compiles stopped at their time or memory budget since start
    preempted: int = 0   # compiles stopped for a shorter one and queued again, since start


@dataclass
class _Job:
    kind: str
    text: str
    large: bool
    future: concurrent.futures.Future
    size: int = 0                   # the text's bytes: the cost estimate (shortest first)
    seq: int = 0                    # arrival order, among equal sizes
    preemptions: int = 0            # times it was stopped for a shorter one
    started: float | None = None    # when its current run began (None: queued)
    lane: int = -1                  # the child running it
    client: str = ""                # who asked for it (the fair share's key)

    def __lt__(self, other: "_Job") -> bool:         # shortest first, then oldest
        return (self.size, self.seq) < (other.size, other.seq)


class CompilePool:
    def __init__(self, tokenizer_info: Callable[[], str], size: int | None, timeout_s: float, memory_bytes: int):
        self.size = default_size() if size is None else max(1, size)
        self.large_cap = max(1, self.size - 1)          # children large compiles may hold at once
        self._tokenizer_info, self.timeout_s, self.memory_bytes = tokenizer_info, timeout_s, memory_bytes
        self._info_json: str | None = None
        self._info_lock = threading.Lock()
        self._workers: list[CompileWorker | None] = [None] * self.size
        self._cond = threading.Condition()
        # fresh levels (in arrival order; taken shortest first), then the long level (compiles stopped for a
        # shorter one: first come first served)
        self._small: list[_Job] = []
        self._large: list[_Job] = []
        self._long: deque[_Job] = deque()
        self._current: list[_Job | None] = [None] * self.size     # the compile each child runs
        self._running = self._running_large = self._compiled = self._preempted = self._seq = 0
        self._by_client: dict[str, int] = {}     # client -> its compiles running now
        self._last_start: dict[str, float] = {}  # client -> when a compile of its started last (while it has any)
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, args=(i,), name=f"kvmesh-grammar-{i}", daemon=True)
                         for i in range(self.size)]
        self._threads.append(threading.Thread(target=self._slices, name="kvmesh-grammar-slices", daemon=True))
        for t in self._threads:
            t.start()

    def submit(self, text: str, kind: str = "json_schema", client: str = "") -> concurrent.futures.Future:
        """Queue one compile for `client`; its future holds the serialized grammar, or raises
        ValueError (unusable), CompileBudgetExceeded (stopped at its budget) or RuntimeError
        (pool closed)."""
        size = len(text.encode())
        job = _Job(kind, text, size >= LARGE_TEXT_BYTES, concurrent.futures.Future(), size, client=client)
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar compile pool is closed")
            self._seq += 1
            job.seq = self._seq
            (self._large if job.large else self._small).append(job)
            self._cond.notify_all()
        return job.future

    def _take(self, index: int) -> _Job | None:
        """The next compile child `index` may run (see the module docstring); None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                job = self._next()
                if job is None:
                    self._cond.wait()
                    continue
                self._running += 1
                self._running_large += job.large
                self._by_client[job.client] = self._by_client.get(job.client, 0) + 1
                job.started, job.lane = time.monotonic(), index
                self._current[index] = job
                return job

    def _share(self) -> int:
        """Children per client now (the lock held): the pool divided among the clients with a
        compile queued or running, rounded up."""
        clients = {j.client for j in self._queued()}
        clients.update(c for c, n in self._by_client.items() if n)
        return -(-self.size // max(1, len(clients)))

    def _next(self) -> _Job | None:
        """Take the compile to run next (the lock held), None when none may start: among those a
        free child may take, the client with the fewest compiles running, then the one that
        started one longest ago (round robin), then the levels' order."""
        room = self._running_large < self.large_cap
        fresh = [*self._small, *(self._large if room else [])]
        rows = [((j.large, j.size, j.seq), j) for j in fresh]      # small first, then shortest, then oldest
        rows += [((2, at, 0), j) for at, j in enumerate(self._long) if room or not j.large]    # first come first served
        if not rows:
            return None
        order, job = min(rows, key=lambda row: (self._by_client.get(row[1].client, 0),
                                                self._last_start.get(row[1].client, -1.0), row[0]))
        if order[0] == 2:
            self._long.remove(job)
        else:
            (self._large if job.large else self._small).remove(job)
        self._last_start[job.client] = time.monotonic()
        return job

    def _slices(self) -> None:
        """Stop a compile that has had its slice when a shorter fresh one waits for its child."""
        with self._cond:
            while not self._closed:
                victim = self._victim(time.monotonic())
                if victim is not None:
                    victim.preemptions += 1
                    self._workers[victim.lane].preempt()
                    victim.started = None           # asked once; its lane requeues it
                waiting = self._small or self._large or self._long
                self._cond.wait(SLICE_S / 10 if waiting else None)     # submit() wakes it

    def _victim(self, now: float) -> _Job | None:
        """The compile to stop now, if any (the lock held): for a client under its share whose
        compile cannot start, the longest compile of a client over its share; else the longest
        text among those longer than the shortest fresh compile that cannot start. Either way
        only one that has run SLICE_S, may be stopped again, and whose child the waiting compile
        may take (a large one never takes the kept child)."""
        if any(j is not None and j.started is None for j in self._current):
            return None         # one asked to stop already: its child frees (after a restart) for the waiting one
        share = self._share()
        starved = [j for j in self._queued() if self._by_client.get(j.client, 0) < share
                   and not self._startable(j)]
        if starved:
            waiting = min(starved)
            victim = self._longest(now, waiting, lambda j: self._by_client.get(j.client, 0) > share)
            if victim is not None:
                return victim
        waiting = min(self._small or self._large, default=None)     # the shortest fresh one, small first
        if waiting is None or self._startable(waiting):
            return None
        return self._longest(now, waiting, lambda j: j.size > waiting.size)

    def _queued(self) -> tuple[_Job, ...]:
        return (*self._small, *self._large, *self._long)

    def _startable(self, job: _Job) -> bool:
        """A child is free that `job` may take (the lock held)."""
        return self._running < self.size and (not job.large or self._running_large < self.large_cap)

    def _longest(self, now: float, waiting: _Job, eligible: Callable[[_Job], bool]) -> _Job | None:
        candidates = [j for j in self._current if j is not None and j.started is not None
                      and now - j.started >= SLICE_S and eligible(j)
                      and j.preemptions < MAX_PREEMPTIONS and (j.large or not waiting.large)
                      and self._workers[j.lane] is not None]
        return max(candidates, key=lambda j: (j.size, -j.seq), default=None)

    def _serve(self, index: int) -> None:
        """One child's thread: start it, then run compiles until the pool closes. A child killed
        for its budget restarts before its lane frees (so a large compile's restart never takes
        the child kept for small ones)."""
        try:
            worker = CompileWorker(self._info(), self.timeout_s, self.memory_bytes)
        except Exception:
            log.exception("grammar compile pool: no tokenizer info; this child never starts")
            return
        with self._cond:
            if self._closed:
                return
            self._workers[index] = worker
        self._restart(worker)
        while (job := self._take(index)) is not None:
            stopped, preempted = worker.stopped, False
            try:
                if job.preemptions or job.future.set_running_or_notify_cancel():
                    job.future.set_result(worker.compile(job.text, job.kind))
            except CompilePreempted:        # a shorter one takes this child; this one waits again
                preempted = True
            except Exception as e:          # ValueError / CompileBudgetExceeded / closed: the caller's to see
                job.future.set_exception(e)
            with self._cond:
                self._compiled += not preempted
                self._preempted += preempted
            if worker.stopped != stopped or preempted:
                self._restart(worker)
            with self._cond:
                self._running -= 1
                self._running_large -= job.large
                self._by_client[job.client] -= 1
                if not self._by_client[job.client]:
                    del self._by_client[job.client]
                    if not preempted and all(j.client != job.client for j in self._queued()):
                        self._last_start.pop(job.client, None)
                self._current[index] = None
                job.started = None
                if preempted:
                    if self._closed:
                        job.future.set_exception(RuntimeError("the grammar compile pool is closed"))
                    else:
                        self._long.append(job)
                self._cond.notify_all()

    def _info(self) -> str:
        with self._info_lock:
            if self._info_json is None:
                self._info_json = self._tokenizer_info()
            return self._info_json

    def _restart(self, worker: CompileWorker) -> None:
        try:
            worker.start()
        except Exception as e:             # closed, or it did not start: the next compile tries again
            if not self._closed:
                log.warning("grammar compiler process: %s", e)

    def stats(self) -> PoolStats:
        with self._cond:
            workers = [w for w in self._workers if w is not None]
            return PoolStats(sum(w.alive for w in workers), self._running,
                             len(self._small) + len(self._large) + len(self._long), self._compiled,
                             sum(w.stopped for w in workers), self._preempted)

    def close(self) -> None:
        """Stop every child (a compile in progress raises) and fail what is queued."""
        with self._cond:
            self._closed = True
            queued = [*self._small, *self._large, *self._long]
            self._small.clear()
            self._large.clear()
            self._long.clear()
            workers = [w for w in self._workers if w is not None]
            self._cond.notify_all()
        for job in queued:
            if job.preemptions or job.future.set_running_or_notify_cancel():     # a requeued one runs already
                job.future.set_exception(RuntimeError("the grammar compile pool is closed"))
        for w in workers:
            w.close()
