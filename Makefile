# `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
TESTS ?= tests

.PHONY: venv demo test clean
venv:
	@scripts/ensure_venv.sh $(PYTHON) $(VENV)

demo: venv
	$(VENV)/bin/python examples/tutorial.py

test: venv
	$(VENV)/bin/python -m pytest $(TESTS)

clean:
	rm -rf $(VENV) build *.egg-info
