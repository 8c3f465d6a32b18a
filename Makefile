# keras_linattn: `make demo` and `make test` work on a fresh machine with Python 3.11 + pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-slow bench install clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e ".[test,serving,bench]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m examples.demo

test: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest -q tests

test-fast: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest -q -m "not slow" tests

test-slow: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest -q -m slow tests --runslow

bench: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m benchmarks.bench_attention

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
