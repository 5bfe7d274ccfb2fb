# Everything a fresh machine needs: `make demo` runs the demo, `make test` runs lint + tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/specmerge demo

lint: $(VENV)/.installed
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

test: lint
	$(BIN)/pytest

bench: $(VENV)/.installed
	$(BIN)/python bench/layer_speed.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache src/*.egg-info
