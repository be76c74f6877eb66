"""A new user's install: a fresh venv, `pip install` of the checkout with no pins beside it (so the
newest transformers and the Hugging Face `kernels` package it requires), then `kvmesh generate` on the
built-in model from a folder outside the checkout, before and after HF's `kernels` is reinstalled, with
HF's package importable throughout. kvmesh installs one top-level name, `kvmesh`: when it installed
`cluster`, `workers`, `kernels` and `kvstore`, whichever of the two `kernels` was written last owned
`site-packages/kernels/__init__.py` and the other one was broken (issue 44).

Only the CPU torch wheel that lies on this machine's disk is installed first (as scripts/setup.sh
does), so pip never pulls a CUDA build; everything else comes from the package index (pip's cache
after the first run). The venv is built in the background while other tests run
(tests/integration/clean_install.py)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.integration.clean_install import venv_for

PROMPTS = ["The king said to his servants,", "In the beginning"]
PIP_TIMEOUT_S = 900

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def venv(request) -> Path:
    """A fresh venv with the checkout installed as a user would: `pip install <checkout>`, no pins
    (tests/integration/clean_install.py: built in the background from the session's start)."""
    env, own = venv_for(request.config, PIP_TIMEOUT_S)
    yield env
    if own is not None:
        own.stop()


def site_packages(env: Path) -> Path:
    return next((env / "lib").glob("python3*/site-packages"))


def generate(env: Path, workdir: Path, name: str) -> list[str]:
    """`kvmesh generate` on the built-in model, run from `workdir` (outside the checkout)."""
    requests = workdir / f"{name}.jsonl"
    requests.write_text("".join(json.dumps({"id": str(i), "prompt": p, "max_tokens": 8, "temperature": 0}) + "\n"
                                for i, p in enumerate(PROMPTS)))
    output = workdir / f"{name}.out.jsonl"
    run([str(env / "bin" / "kvmesh"), "generate", "--input", str(requests), "--output", str(output)], workdir)
    rows = sorted((json.loads(line) for line in output.read_text().splitlines()), key=lambda r: r["id"])
    return [r["text"] for r in rows]


def hf_kernels_works(env: Path, workdir: Path) -> None:
    run([str(env / "bin" / "python"), "-c", "from kernels import get_kernel; print(get_kernel)"], workdir)


def test_a_plain_pip_install_beside_hf_kernels_serves_from_anywhere_and_survives_its_reinstall(venv, tmp_path):
    packages = site_packages(venv)
    assert next(packages.glob("kernels-*.dist-info"), None), "the newest transformers no longer pulls HF's kernels"
    hf_kernels_works(venv, tmp_path)
    first = generate(venv, tmp_path, "before")
    assert len(first) == len(PROMPTS) and all(first), first

    run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check",
         "--force-reinstall", "--no-deps", "kernels"], tmp_path, PIP_TIMEOUT_S)
    hf_kernels_works(venv, tmp_path)
    assert generate(venv, tmp_path, "after") == first

    dist = next(packages.glob("kvmesh-*.dist-info"))
    assert (dist / "top_level.txt").read_text().split() == ["kvmesh"]
    assert not any((packages / name).exists() for name in ("cluster", "workers", "kvstore"))
    assert (packages / "kvmesh" / "workers" / "checkpoint" / "default_checkpoint" / "model.safetensors").is_file()
