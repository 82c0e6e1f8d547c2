# swin-backbone: every target sets up what it needs (idempotent; seconds when nothing changed).
#
# make test   = the full suite on today's stack (.venv: torch 2.14.1, mmcv-lite: nothing compiled) and
#               the compatibility suites on the old stacks users have (docs/compatibility.md):
#                 .venv-torch2.1  torch 2.1.2 + mmcv 2.1.0 (compiled) + mmdet 3.3 + mmseg 1.2 + numpy 1.x
#                 .venv-torch2.0  torch 2.0.1 (the floor) + mmengine + numpy 1.x, no mmcv
#               `make test COMPAT=0` (or PYTEST_ARGS=...) runs today's stack only.
#               Every suite runs in JOBS pytest-xdist workers (default 2, the test machine's cores; a
#               test file to a worker at a time: a module's fixtures are built once); JOBS=1: one process.
# make test-fast = the quick tier while working (under 10 minutes on a 2-core machine): today's stack
#               only, without the `slow` and `install` tests or FAST_SKIP's (below); `make test` runs those too.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
JOBS ?= 2
XDIST := $(if $(filter 1,$(JOBS)),,-n $(JOBS) --dist loadfile)
COMPAT ?= $(if $(PYTEST_ARGS),0,1)

# What the old stacks run. Whole directories (new test files join by themselves); tests that need a
# newer torch skip through the `torch_feature` marker (tests/conftest.py), naming the feature.
# tests/mmlab needs mmdet / mmseg: on torch 2.1 the real end-to-end integration (mmdet Mask R-CNN and
# mmseg UPerNet: train, resume, test with the real metrics) runs; the rest of tests/mmlab is
# library-level behaviour already covered on today's stack.
COMPAT_CORE := tests/test_compat.py tests/model tests/ops tests/checkpoint
# Of tests/tools, the feature-extraction tool's tests (a user tool; the benchmark is a developer
# tool, run on today's stack).
COMPAT_TOOLS := $(wildcard tests/tools/test_*feature*.py)
# tests/mmcv_lite: our stand-in ops against the compiled ones, op by op and end to end (the one
# stack with compiled mmcv).
COMPAT_TORCH21 := $(COMPAT_CORE) $(COMPAT_TOOLS) tests/mmlab/test_tools_train.py::test_train_resume_and_test \
	tests/mmcv_lite
# The floor has no mmdet: test_tool_from_config_and_glob reads an mmdet config.
COMPAT_TORCH20 := $(COMPAT_CORE) $(COMPAT_TOOLS) \
	--deselect tests/tools/test_tools_extract_features.py::test_tool_from_config_and_glob
COMPAT_PYTEST := -m "not install" -p no:cacheprovider $(XDIST)

# The fast tier (`make test-fast`): today's stack, without the tests marked `install` (wheels built
# and pip-installed into fresh venvs) or `slow` (setup.cfg: torch.compile; subprocesses: python,
# the tools, the console scripts and converter; several processes: torchrun ranks and nodes,
# spawned ranks, 2-process cache / lock races; and the benchmark run end to end), and without
# FAST_SKIP's paths: real mmdet / mmseg training, FSDP and the shipped / drop-in configs
# (tests/mmlab), mmcv-lite's end-to-end runs (tests/mmcv_lite), the feature extractor's dataset runs
# (torchrun ranks among them), the library configs' stock Swin-B / L weights. Nor the old stacks
# (`make test-compat`). tests/test_fast_tier.py checks that the tests calling torch.compile or
# starting a process carry the mark. About 3 minutes on the 2-core test machine in 2 workers
# (`make test` runs everything: about 30 minutes).
FAST_SKIP := tests/mmlab tests/mmcv_lite tests/tools/test_features_dataset_runs.py \
	tests/checkpoint/test_stock_config_weights.py

.PHONY: setup setup-compat test test-fast test-main test-compat test-torch2.1 test-torch2.0 demo demo-seg bench \
	clean-data

setup:
	@bash tools/setup_env.sh

setup-compat:
	@bash tools/setup_env.sh torch2.1
	@bash tools/setup_env.sh torch2.0

# The old stacks are set up first: tests/test_install.py checks that installing the package into
# them plans no change to their torch.
ifeq ($(COMPAT),1)
test: setup setup-compat
	@status=0; \
	$(MAKE) --no-print-directory test-main || status=1; \
	$(MAKE) --no-print-directory -k test-compat || status=1; \
	exit $$status
else
test: setup test-main
endif

test-main: setup
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not install and not slow" $(XDIST) $(addprefix --ignore=,$(FAST_SKIP)) $(PYTEST_ARGS)

test-compat: test-torch2.1 test-torch2.0

test-torch2.1:
	@bash tools/setup_env.sh torch2.1
	.venv-torch2.1/bin/python -m pytest $(COMPAT_PYTEST) $(COMPAT_TORCH21)

test-torch2.0:
	@bash tools/setup_env.sh torch2.0
	.venv-torch2.0/bin/python -m pytest $(COMPAT_PYTEST) $(COMPAT_TORCH20)

demo: setup
	$(PY) tools/demo.py

bench: setup
	$(PY) tools/analysis_tools/benchmark.py $(BENCH_ARGS)

clean-data:
	rm -rf data/toy_coco data/toy_ade work_dirs/demo*
