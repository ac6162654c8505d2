# appo-trl developer commands. `make test` and `make demo` create .venv when it is missing.
.PHONY: install test test-fast demo bench quality clean

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
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -U pip
	# CPU torch first: pip takes the local 2.13.0+cpu wheel instead of a CUDA download.
	$(PIP) install -q "torch>=2.6,<2.14"
	$(PIP) install -q -e ".[test,deepspeed,dev]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q tests

test-fast: install
	$(PY) -m pytest -q -m "not slow" tests

demo: install
	$(VENV)/bin/appo demo

bench: install
	$(PY) bench/tools.py
	$(PY) bench/rollout.py
	$(PY) bench/trainer.py

quality: install
	$(VENV)/bin/ruff check appo_trl tests bench sft eval
	$(VENV)/bin/ruff format --check appo_trl tests bench sft eval

clean:
	rm -rf $(VENV) build dist *.egg-info outputs .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
