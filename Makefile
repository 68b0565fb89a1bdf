# Two entry points for a fresh machine: `make demo` and `make test`.
# uv resolves the CPU stack from uv.lock (torch CPU wheel via [tool.uv] find-links).
UV ?= $(shell command -v uv 2>/dev/null || echo python3 -m uv)
DATA_DIR ?= $(abspath ../shared/data)
export QSERVE_DATA_DIR ?= $(DATA_DIR)
# Python writes each module's bytecode at its first import (into .venv and the clone), which a machine
# image that sets PYTHONDONTWRITEBYTECODE=1 would forbid: every run would compile again.
unexport PYTHONDONTWRITEBYTECODE
# The demo's gate: word perplexity on 150 GSM8K test solutions (docs/install.md: "Why the demo gates on perplexity").
RECIPE ?= recipes/w8a8-int8.yaml
TASKS ?= gsm8k_ppl
LIMIT ?= 150

# DEVICE=cuda on an NVIDIA machine (docs/install.md): `make setup DEVICE=cuda` installs vLLM's CUDA wheel
# with the dev group and the project's overrides in place of the CPU lock (.ci/cuda-setup), and every
# target below then runs on that environment as it is, never re-syncing the CPU lock over it.
DEVICE ?= cpu

.PHONY: setup setup-cpu setup-cuda demo test test-matrix test-fast matrix docs benchmarks lint

# Each target below runs `setup` first; `uv run --no-sync` then uses that environment as it is (uv run
# would sync again, and recheck the bytecode of every installed file).

setup: setup-$(DEVICE)

setup-cpu:
	@$(UV) --version >/dev/null 2>&1 || python3 -m pip install --user --quiet uv
	$(UV) sync --locked --extra cpu --quiet

setup-cuda:
	@$(UV) --version >/dev/null 2>&1 || python3 -m pip install --user --quiet uv
	python3 .ci/cuda-setup "$(UV)"

# quantize -> eval (gates) -> serve, on the embedded SmolLM2-135M-Instruct, offline; a second
# `make demo` reuses the checkpoint and its gate and goes straight to serving.
demo: setup
	$(UV) run --no-sync qserve run $(RECIPE) --tasks $(TASKS) --limit $(LIMIT)

test: setup
	$(UV) run --no-sync pytest -ra --durations=50 -m "not matrix"

# The per-recipe cells beyond make test's slice (tests/test_support.py: the recipes nothing else in the
# suite quantizes; tests/test_serve_matrix.py: the served text of each servable scheme beyond INT8;
# tests/test_tune.py: the shipped tuned recipe; tests/test_real_weights.py: Gemma 3 through the demo;
# tests/test_gate_levels.py: the level of later looks, on four times the draws; tests/test_quantize.py: the
# tuned recipe re-run through raw llm-compressor; tests/test_gate_outside_runs.py: real lm-eval runs made
# outside and gated with --checkpoint; tests/test_parallel.py: tensor and pipeline parallel on two CPU
# processes; tests/test_install.py: the GPU install's set from PyPI; and, to keep make test within 30
# minutes: compare's shared baseline, the all-patches-off eval, the 2:4 sparsity recipe's tests, two-process
# GPTQ, quantizing a model larger than the memory limit);
# .ci/run runs it after make test. It starts from the checkpoints make test made from the same sources
# (kept in the test cache, tests/conftest.py's `keep`), so it does not quantize them or run the demo again.
test-matrix: setup
	$(UV) run --no-sync pytest -ra --durations=10 -m matrix

test-fast: setup
	$(UV) run --no-sync pytest -ra -m "not slow"

# Every architecture x every shipped scheme, run for real on tiny random-initialised models; regenerates
# docs/architectures.md and its .json (the page gives the run's date, commit, machine and time).
# `--resume` keeps what an interrupted run finished, and serves cells an earlier run did not.
matrix: setup
	$(UV) run --no-sync qserve matrix --out docs/architectures.md

# The CLI reference, from the commands' own --help, the benchmarks page, from the recorded results, the
# patch table and the benchmark-power page (tests/test_cli.py, test_compat.py and test_benchmark_power.py
# fail when one is stale).
docs: setup
	$(UV) run --no-sync python -m qserve.cli.reference > docs/cli.md
	$(UV) run --no-sync python -m qserve.bench.page docs > docs/benchmarks.md
	$(UV) run --no-sync python -m qserve.compat > docs/patches.md
	$(UV) run --no-sync python -m qserve.gate.power > docs/benchmark-power.md

# qserve against the raw libraries on this machine, side by side, then `make demo` from a fresh clone
# step by step; records both in docs/benchmarks/ and regenerates docs/benchmarks.md from every machine.
benchmarks: setup
	$(UV) run --no-sync qserve bench --suite --work-dir .bench-suite --publish docs
	$(UV) run --no-sync qserve bench --demo --work-dir .bench-suite --publish docs

# The linter and the formatter own the code's layout (a table laid out by hand says why, in `# fmt: off`).
lint:
	$(UV) tool run ruff@0.17.6 check qserve tests
	$(UV) tool run ruff@0.17.6 format --check qserve tests
