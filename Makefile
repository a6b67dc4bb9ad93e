# Two commands for a fresh clone: `make demo` and `make test`. Everything lands inside the clone.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
# specdeploy's default bundle location (the demo bundle is exported there on first use).
export SPECDEPLOY_HOME ?= $(CURDIR)/.specdeploy
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

DEMO_PROMPT ?= def fibonacci(n):\n

.PHONY: demo test bench install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch is pinned first and by version: a bare requirement may pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[export,test,bench,serve]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/specdeploy export --force
	$(BIN)/specdeploy run --prompt "$$(printf '$(DEMO_PROMPT)')" --max-new-tokens 96

test: $(VENV)/.installed
	$(BIN)/python -m pytest tests

bench: $(VENV)/.installed
	$(BIN)/specdeploy bench

clean:
	rm -rf $(VENV) $(SPECDEPLOY_HOME) .pytest_cache
