# Two entry points for a fresh machine: `make demo` and `make test`.
# uv resolves the CPU stack from uv.lock (torch CPU wheel via [tool.uv] find-links).
UV ?= $(shell command -v uv 2>/dev/null || echo python3 -m uv)
DATA_DIR ?= $(abspath ../shared/data)
export QSERVE_DATA_DIR ?= $(DATA_DIR)
RECIPE ?= recipes/w8a8-int8.yaml
DEMO_OUT ?= out-w8a8-int8
LIMIT ?= 20

.PHONY: setup demo test test-fast

setup:
	@$(UV) --version >/dev/null 2>&1 || python3 -m pip install --user --quiet uv
	$(UV) sync --locked --extra cpu

# quantize -> eval (gates) -> serve, on the embedded SmolLM2-135M-Instruct, offline.
demo: setup
	$(UV) run --locked --extra cpu qserve quantize $(RECIPE) --output $(DEMO_OUT) --force
	$(UV) run --locked --extra cpu qserve eval $(DEMO_OUT) --tasks gsm8k_ppl,gsm8k --limit $(LIMIT)
	$(UV) run --locked --extra cpu qserve serve $(DEMO_OUT)

test: setup
	$(UV) run --locked --extra cpu pytest -ra --durations=15

test-fast: setup
	$(UV) run --locked --extra cpu pytest -ra -m "not slow"
