# The two commands a newcomer needs:
#   make run   - install, start the service on the embedded default (tiny model, CPU) and stream a generation
#   make test  - install, lint, type-check, check the generated stubs and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run

.PHONY: install lock native run serve test lint typecheck stubs-check pytest protos bench clean

# The scheduler compiled with mypyc (cdb_scheduler/_native.py): rebuilt when a compiled module changes. Without a C
# compiler the build fails and the scheduler runs interpreted, as it does whenever the build does not match.
NATIVE := cdb_scheduler/_native_build/manifest.json
NATIVE_SOURCES := $(filter-out %/__init__.py %/_native.py %/prefill.py %/invariants.py %/sampling.py,$(wildcard cdb_scheduler/*.py))

# uv installs the locked versions (requirements/constraints.txt) in seconds where pip takes minutes; the pinned torch
# comes from this machine's wheel folder (PIP_FIND_LINKS), a CPU build: an unpinned torch would pull a multi-GB
# CUDA build.
UV_VERSION := 0.13.9
FIND_LINKS := $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS),)

$(STAMP): pyproject.toml requirements/constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q "uv==$(UV_VERSION)"
	$(BIN)/uv pip install -q --python $(BIN)/python $(FIND_LINKS) -c requirements/constraints.txt \
		"torch==2.13.0" -e ".[dev,eval]"
	touch $(STAMP) $(RUN_STAMP)

# What running needs, no more (`make run`, `make serve`): the project and its dependencies, without the tools and
# the evaluation harness the suite uses (about 600 MB fewer; the scheduler then runs interpreted).
$(RUN_STAMP): pyproject.toml requirements/constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q "uv==$(UV_VERSION)"
	$(BIN)/uv pip install -q --python $(BIN)/python $(FIND_LINKS) -c requirements/constraints.txt "torch==2.13.0" -e .
	touch $(RUN_STAMP)

# Re-resolve the locked versions after a change to pyproject.toml's dependencies (then run the suite on them).
LOCK_HEADER := \# The versions \`make install\` installs (uv, under these constraints): regenerate with \`make lock\`.
lock: $(STAMP)
	echo "torch==2.13.0" | $(BIN)/uv pip compile -q - pyproject.toml --extra dev --extra eval $(FIND_LINKS) \
		--python $(BIN)/python --no-header --no-annotate | sed 's/+cpu$$//' > requirements/constraints.new
	{ echo "$(LOCK_HEADER)"; grep -v '^cdb' requirements/constraints.new; } > requirements/constraints.txt
	rm requirements/constraints.new

$(NATIVE): $(STAMP) $(NATIVE_SOURCES) cdb_scheduler/_native.py
	$(BIN)/cdb native build || echo "cdb native build failed: the scheduler runs interpreted"

native: $(NATIVE)

install: $(STAMP) $(NATIVE)

run: $(RUN_STAMP)
	$(BIN)/cdb demo

serve: $(RUN_STAMP)
	$(BIN)/cdb serve

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

stubs-check: $(STAMP)
	$(BIN)/python -m cdb_api.build --check

# Bytecode is cached for the suite even where PYTHONDONTWRITEBYTECODE is set: it starts a few hundred Python
# processes (the process-tree tests), each of which would compile the project's modules again (~0.5 s each). In
# the usual __pycache__ folders, where pip has already compiled the installed packages (a PYTHONPYCACHEPREFIX
# would make the first processes compile torch and the rest again: ~1 minute of a clean clone's run).
pytest: install
	PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX= $(BIN)/python -m pytest -q --durations=15

# The checks run beside the scheduler's compilation and the suite (which leaves a quarter of two cores idle,
# waiting on its process trees): two jobs at a time, the suite last (it needs the compiled scheduler); the first
# failure stops what has not started. mypy prints one line when it is done.
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 lint stubs-check typecheck pytest

protos: install
	$(BIN)/python -m cdb_api.build

bench: install
	$(BIN)/cdb bench offline

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .pycache cdb_scheduler/_native_build
