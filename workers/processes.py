"""The start method of every child process an engine makes on its own machine: tensor- and
data-parallel ranks (workers.parallel.replica.LocalProcessLauncher) and schema compilers
(workers.sampling.grammar_worker.CompileWorker).

    p = start_child(main, (rank, ...), name="kvmesh-rank1")    # a daemonic child running main(*args)

`forkserver` (Python 3.14's default on Linux): the process's first child starts a server that
imports PRELOAD and nothing else (no kvmesh thread; only what a library starts at import, such as
OpenBLAS's pool, which re-creates itself in a fork), and every child is a fork of it. A child so
starts in milliseconds instead of importing torch and its own code for ~2 s of a core as a
`spawn` child does (xgrammar: ~0.6 s more). The server never touches CUDA (no preloaded module
initializes it at import), so a rank may still take cuda:r. A fork would inherit the server's
environment, from when the first child started; start_child gives it its parent's now, as
`spawn` did. The preload is ignored if something else started this process's fork server
first (children then import as spawned ones do); where `forkserver` is missing, `spawn`.
"""
from __future__ import annotations

import multiprocessing
import os
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Callable

# imported once by the fork server (names, not imports: a module missing here is skipped)
PRELOAD = ["torch", "xgrammar", "kvmesh.workers.parallel.replica", "kvmesh.workers.engine.dp_rank",
           "kvmesh.workers.sampling.grammar_worker"]


def start_child(target: Callable[..., None], args: tuple, name: str) -> BaseProcess:
    """A daemonic child, started, that runs `target(*args)` (a module-level function)."""
    p = _context().Process(target=_run, args=(target, args, dict(os.environ)), name=name, daemon=True)
    p.start()
    return p


def _context() -> BaseContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _run(target: Callable[..., None], args: tuple, environ: dict[str, str]) -> None:
    if environ != os.environ:       # the parent's at the child's start
        os.environ.clear()
        os.environ.update(environ)
    target(*args)
