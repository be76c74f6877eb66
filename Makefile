.PHONY: setup serve test test-fast bench

setup:
	./scripts/setup.sh

serve: setup
	.venv/bin/kvmesh serve

test: setup
	.venv/bin/python -m pytest -q tests

test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow" tests

bench: setup
	.venv/bin/python bench/engine.py
