"""The fresh venv of test_clean_install.py, built in the background from the session's start.

Building it is ~60 s of pip (one core, and waits on the package index): as the test's own
set-up that held a pytest worker for 65-100 s. The session's first process (the xdist
controller, or pytest alone) starts it at `nice 10` when the run may include the test, so pip
uses what the tests leave idle; the test waits for what is left of it. The controller removes
the folder (and stops pip if it still runs) when the session ends; a test that finds no
background build (the test run another way) builds the venv itself, in the foreground.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests/integration/test_clean_install.py"
TORCH = "torch==2.13.0"          # the CPU build on this machine's disk (scripts/setup.sh's default)
IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "build", "dist", "*.egg-info", ".pytest_cache",
                                ".hypothesis", ".kvmesh", "bench", "tests", "docs")
# a user's two commands, no pins: the CPU torch first (so pip never takes a CUDA build), then kvmesh
SCRIPT = """set -e
"$PY" -m venv "$DIR/v"
pip() { "$DIR/v/bin/python" -m pip install -q --no-compile --disable-pip-version-check "$@"; }
pip "$TORCH"
pip "$DIR/kvmesh-src"
"""
WORKERINPUT = "kvmesh_clean_install_dir"


def wanted(config: pytest.Config) -> bool:
    """Whether this run may include the test: slow tests not deselected, and the test module
    under one of the paths given (a -k filter may still leave it out: then pip ran for nothing)."""
    if "not slow" in (config.option.markexpr or ""):
        return False
    module = (ROOT / MODULE).resolve()
    paths = [Path(a.split("::")[0]).resolve() for a in config.args] or [ROOT / "tests"]
    return any(module == p or p in module.parents for p in paths)


class BackgroundInstall:
    def __init__(self, folder: Path, proc: subprocess.Popen | None = None):
        self.folder, self.proc = folder, proc

    @classmethod
    def start(cls, niceness: int = 10) -> "BackgroundInstall":
        folder = Path(tempfile.mkdtemp(prefix="kvmesh-clean-install-"))
        shutil.copytree(ROOT, folder / "kvmesh-src", ignore=IGNORE)   # the build writes build/ there
        env = {**os.environ, "DIR": str(folder), "PY": sys.executable, "TORCH": TORCH}
        with open(folder / "log", "w") as log:
            proc = subprocess.Popen(["nice", "-n", str(niceness), "bash", "-c", f'({SCRIPT}); echo $? > "$DIR/rc"'],
                                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return cls(folder, proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    @staticmethod
    def wait(folder: Path, timeout_s: float) -> Path:
        """The venv once pip is done; fails with pip's log if it failed or never finished."""
        deadline, rc = time.monotonic() + timeout_s, folder / "rc"
        while not rc.exists() and time.monotonic() < deadline and (folder / "log").exists():
            time.sleep(1)
        log = (folder / "log").read_text()[-4000:] if (folder / "log").exists() else "(its folder is gone)"
        assert rc.exists() and rc.read_text().strip() == "0", f"the clean install failed or did not finish:\n{log}"
        return folder / "v"


def venv_for(config: pytest.Config, timeout_s: float) -> tuple[Path, BackgroundInstall | None]:
    """The background build's venv, else one built here (and its BackgroundInstall to stop)."""
    folder = getattr(config, "workerinput", {}).get(WORKERINPUT) or getattr(config, "_kvmesh_clean_install", None)
    if folder:
        return BackgroundInstall.wait(Path(folder), timeout_s), None
    own = BackgroundInstall.start(niceness=0)
    return BackgroundInstall.wait(own.folder, timeout_s), own
