# The two commands of the README: `make serve` and `make test`. Both set up .venv first.
.PHONY: setup serve test test-fast bench

setup:
	./scripts/setup.sh

serve: setup
	.venv/bin/kvmesh serve

# One intra-op thread per process: the suite runs many small ops in several processes
# (Ray workers, Redis, subprocess CLIs) on 2 cores, where OpenMP spinning costs 10-100x.
test: setup
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests

test-fast: setup
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m "not slow" tests

bench: setup
	OMP_NUM_THREADS=1 .venv/bin/python bench/engine.py
	OMP_NUM_THREADS=1 .venv/bin/python bench/prefix_reuse.py
	OMP_NUM_THREADS=1 .venv/bin/python bench/serve.py
