# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch is pinned so pip takes the CPU wheel on this machine instead of a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: venv demo shim test lint bench bench-long clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,hf,ray,plot,logger]" "$(TORCH)"
	touch $(STAMP)

# `rlbus` lives in .venv/bin: the demo says how to call it without activating the venv.
demo: $(STAMP)
	@$(VENV)/bin/rlbus up --config configs/demo.yaml; rc=$$?; echo; \
	echo "rlbus is installed in $(CURDIR)/$(VENV)/bin: call it as $(VENV)/bin/rlbus ..., or"; \
	echo "'. $(VENV)/bin/activate' first, or 'make shim' to link it into ~/.local/bin."; \
	exit $$rc

# A link on PATH works without activating the venv: the script's shebang names .venv's python.
SHIM_DIR ?= $(HOME)/.local/bin
shim: $(STAMP)
	mkdir -p $(SHIM_DIR)
	ln -sf $(CURDIR)/$(VENV)/bin/rlbus $(SHIM_DIR)/rlbus
	@echo "linked $(SHIM_DIR)/rlbus -> $(CURDIR)/$(VENV)/bin/rlbus"
	@case ":$$PATH:" in *":$(SHIM_DIR):"*) ;; *) echo "add $(SHIM_DIR) to PATH";; esac

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The long ones: faults under chaos, and a synthetic run of 100 000 steps (minutes each).
bench-long: $(STAMP)
	$(PY) bench/chaos.py
	$(PY) bench/long_run.py
	$(PY) bench/profiler_fold.py

bench: $(STAMP)
	$(PY) bench/bus_throughput.py
	$(PY) bench/async_speedup.py
	$(PY) bench/time_to_reward.py
	$(PY) bench/profiler_overhead.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
