# The two commands of the README: `make serve` and `make test`. Both set up .venv first.
.PHONY: setup serve test test-fast bench gpu-check

# Every process writes the .pyc of what it imports the first time (scripts/setup.sh compiles only
# torch): with PYTHONDONTWRITEBYTECODE set, as on this project's machines, each Ray worker, replica
# and CLI would compile Ray, transformers and kvmesh from source every time it starts.
unexport PYTHONDONTWRITEBYTECODE

setup:
	./scripts/setup.sh

serve: setup
	.venv/bin/kvmesh serve

# One intra-op thread per process: the suite runs many small ops in several processes
# (Ray workers, Redis, subprocess CLIs) on 2 cores, where OpenMP spinning costs 10-100x.
# --durations=25: the 25 slowest tests after the summary, so a slow newcomer shows in every run.
# -n 2 --dist loadgroup: two pytest-xdist workers, one per core, laid out by tests/lanes.py.
test: setup
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n 2 --dist loadgroup --durations=25 tests

test-fast: setup
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m "not slow" tests

bench: setup
	OMP_NUM_THREADS=1 .venv/bin/python bench/engine.py
	OMP_NUM_THREADS=1 .venv/bin/python bench/prefix_reuse.py
	OMP_NUM_THREADS=1 .venv/bin/python bench/serve.py

# What only a CUDA device can verify, in <= 8 minutes: one table, and gpu_check.json in $OUT
# when set. Prints one "no CUDA" line and exits 0 elsewhere. Sets up .venv only if it is missing
# (a lent device may have no network); PY=... runs another interpreter.
PY ?= .venv/bin/python
gpu-check: $(if $(wildcard $(PY)),,setup)
	OMP_NUM_THREADS=1 $(PY) bench/gpu_check.py $(if $(OUT),--out $(OUT))
