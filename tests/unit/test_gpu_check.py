"""`make gpu-check` (bench/gpu_check.py): without CUDA it says so and exits 0; its
kernel-vs-reference and GEMM comparisons run on the CPU under the Triton interpreter at
small shapes, so the script a lent GPU runs has already run here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "bench/gpu_check.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow     # a subprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: make gpu-check runs for real")
def test_gpu_check_without_cuda_prints_its_no_cuda_line_and_exits_0():
    from bench.gpu_check import NO_CUDA
    done = run()
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == NO_CUDA


@pytest.mark.slow     # make and a subprocess
def test_gpu_check_make_target_runs_the_script(tmp_path):
    make = subprocess.run(["make", "gpu-check", f"PY={sys.executable}", f"OUT={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert make.returncode == 0, make.stdout[-2000:] + make.stderr[-2000:]
    if not torch.cuda.is_available():
        from bench.gpu_check import NO_CUDA
        assert NO_CUDA in make.stdout


@pytest.mark.slow     # every comparison under the Triton interpreter: ~5 s
def test_gpu_check_comparisons_pass_under_the_triton_interpreter(tmp_path):
    pytest.importorskip("triton")
    done = run("--interpret", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["rows"]
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    checks = " ".join(r["check"] for r in rows)
    for op in ("sparse_attention", "compress_windows", "indexer_topk", "FP8 block-scaled", "FP4 grouped"):
        assert op in checks
    assert all(r["ms"] > 0 and r["ref_ms"] > 0 for r in rows)
    assert f"{len(rows)}/{len(rows)} ok" in done.stdout


def test_gpu_check_comparison_flags_a_wrong_kernel_output():
    from bench.gpu_check import compare
    ref = torch.randn(4, 8, dtype=torch.bfloat16)
    assert compare(ref.clone(), ref, exact=False)[0]
    assert not compare(ref + 0.5, ref, exact=False)[0]
    picks = torch.arange(8).view(2, 4)
    assert compare(picks.clone(), picks, exact=True)[0]
    assert not compare(picks.flip(1), picks, exact=True)[0]
