# swin-backbone: every target sets up what it needs (idempotent; seconds when nothing changed).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo demo-seg bench clean-data

setup:
	@bash tools/setup_env.sh

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	$(PY) tools/demo.py

bench: setup
	$(PY) tools/benchmark.py $(BENCH_ARGS)

clean-data:
	rm -rf data/toy_coco data/toy_ade work_dirs/demo*
