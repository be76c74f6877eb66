"""The start method of every child process an engine makes on its own machine: tensor- and
data-parallel ranks (workers.parallel.replica.LocalProcessLauncher) and schema compilers
(workers.sampling.grammar_worker.CompileWorker).

    ctx = child_context()
    p = ctx.Process(target=main, args=(..., dict(os.environ)))    # then apply_environment() in main

`forkserver` (Python 3.14's default on Linux): the process's first child starts a server that
imports PRELOAD and nothing else (no kvmesh thread; only what a library starts at import, such as
OpenBLAS's pool, which re-creates itself in a fork), and every child is a fork of it. A child so
starts in milliseconds instead of importing torch and its own code for ~2 s of a core as a
`spawn` child does (xgrammar: ~0.6 s more). The server never touches CUDA (no preloaded module
initializes it at import), so a rank may still take cuda:r. A child inherits the server's
environment, from when the first child started; apply_environment() gives it its parent's now,
as `spawn` did. The preload is ignored if something else started this process's fork server
first (children then import as spawned ones do); where `forkserver` is missing, `spawn`.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os

# imported once by the fork server (names, not imports: a module missing here is skipped)
PRELOAD = ["torch", "xgrammar", "workers.parallel.replica", "workers.engine.dp_rank",
           "workers.sampling.grammar_worker"]


def child_context() -> multiprocessing.context.BaseContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def apply_environment(environ: dict[str, str]) -> None:
    """In a child: make os.environ its parent's at the child's start (`environ`)."""
    if environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)
