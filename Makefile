# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch is pinned so pip takes the CPU wheel on this machine instead of a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: venv demo test lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,hf,ray,plot]" "$(TORCH)"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlbus up --config configs/demo.yaml

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) bench/bus_throughput.py
	$(PY) bench/async_speedup.py
	$(PY) bench/time_to_reward.py
	$(PY) bench/profiler_overhead.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
