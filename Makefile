# Two entry points (see README): `make demo` and `make test`. Both create or refresh .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build from this machine's local disk; GPU users: see README "Installing on a GPU machine".
TORCH ?= torch==2.13.0

.PHONY: setup demo test test-fast bench lint clean

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check "$(TORCH)"
	$(VENV)/bin/pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash recipes/rlvr.sh

lint: setup
	$(VENV)/bin/ruff check .

# pytest exits 5 when it collects no tests: say so loudly and fail, a suite that runs nothing proves nothing.
test: setup lint
	@rc=0; PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5): treating as failure"; exit 1; fi; exit $$rc

test-fast: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/cli_startup.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/reference_bytes.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/logprob_memory.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/sft_default.py --seeds 0 1 2

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
