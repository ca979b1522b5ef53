# The two commands a newcomer needs:
#   make run   - install, start the service on the embedded default (tiny model, CPU) and stream a generation
#   make test  - install, lint, type-check, check the generated stubs and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install native run serve test lint typecheck stubs-check pytest protos bench clean

# The scheduler compiled with mypyc (cdb_scheduler/_native.py): rebuilt when a compiled module changes. Without a C
# compiler the build fails and the scheduler runs interpreted, as it does whenever the build does not match.
NATIVE := cdb_scheduler/_native_build/manifest.json
NATIVE_SOURCES := $(filter-out %/__init__.py %/_native.py %/prefill.py %/invariants.py %/sampling.py,$(wildcard cdb_scheduler/*.py))

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Pinned: takes the CPU build; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev,eval]"
	touch $(STAMP)

$(NATIVE): $(STAMP) $(NATIVE_SOURCES) cdb_scheduler/_native.py
	$(BIN)/cdb native build || echo "cdb native build failed: the scheduler runs interpreted"

native: $(NATIVE)

install: $(STAMP) $(NATIVE)

run: install
	$(BIN)/cdb demo

serve: install
	$(BIN)/cdb serve

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

stubs-check: install
	$(BIN)/python -m cdb_api.build --check

# Bytecode is cached for the suite even where PYTHONDONTWRITEBYTECODE is set: it starts a few hundred Python
# processes (the process-tree tests), each of which would compile the project's modules again (~0.5 s each). In
# the usual __pycache__ folders, where pip has already compiled the installed packages (a PYTHONPYCACHEPREFIX
# would make the first processes compile torch and the rest again: ~1 minute of a clean clone's run).
pytest: install
	PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX= $(BIN)/python -m pytest -q --durations=15

test: lint typecheck stubs-check pytest

protos: install
	$(BIN)/python -m cdb_api.build

bench: install
	$(BIN)/cdb bench offline

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .pycache cdb_scheduler/_native_build
