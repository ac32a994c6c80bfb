# gemray: `make demo` (set-up + data + main job on ML-1M), `make test` and `make test-slow`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# the shared inputs folder: $GEMRAY_SHARED when set (as for the configs' ../shared/... paths), else ../shared
DATA_SRC ?= $(or $(GEMRAY_SHARED),../shared)/data/ml-1m
OUT ?= runs/demo
DEMO_EPOCHS ?= 10
# The demo trains with per-sequence shared negatives: per-position ones (configs/ml-1m.toml, as HSTU) cost
# ~1.8x more CPU per step and would not fit the 20-minute budget on a 2-core machine.
DEMO_SET ?= model.negatives=uniform_shared

# The tested CPU stack (see README "Install"): `pip install -e .[cpu,test,k8s]` under the constraints file that pins
# every package. torch first from the CPU wheel; torchrec --no-deps because its metadata asks for the CUDA
# fbgemm-gpu, which would overwrite fbgemm-gpu-cpu (same fbgemm_gpu folder).
CONSTRAINTS ?= configs/constraints-cpu.txt
# Where the CPU torch wheel comes from. Empty = pip's configured indexes (this project's machines keep the
# CPU wheel on local disk). Elsewhere use: make demo TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
TORCH_INDEX ?=
PIP = $(BIN)/python -m pip install -q -c $(CONSTRAINTS)

.PHONY: venv install demo demo-config test test-slow lint-imports data clean

$(BIN)/.installed: pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) $(TORCH_INDEX) torch
	$(PIP) -e ".[cpu,test,k8s]"
	$(PIP) --no-deps torchrec
	touch $@

venv install: $(BIN)/.installed

# The demo's config trains MovieLens-1M from data/ml-1m: refuse another release before it overwrites that folder.
data: $(BIN)/.installed
	@test -f "$(DATA_SRC)/ratings.dat" || { echo "make data / make demo: DATA_SRC=$(DATA_SRC) holds no ratings.dat \
	(MovieLens-1M's ratings file; data/ml-1m is left as it is); for another release point a config's data.raw_dir \
	and data.prepared_dir at it (configs/ml-latest-small.toml, README \"Configuration\")" >&2; exit 2; }
	$(BIN)/gemray prepare movielens --src $(DATA_SRC) --out data/ml-1m

DEMO_TRAIN = $(BIN)/gemray train --config configs/ml-1m.toml --set train.epochs=$(DEMO_EPOCHS) $(DEMO_SET) --output $(OUT)

# demo-config first: a bad DEMO_EPOCHS / DEMO_SET is refused before the data are prepared
demo: $(BIN)/.installed demo-config data
	$(DEMO_TRAIN)

demo-config: $(BIN)/.installed
	$(DEMO_TRAIN) --dry-run > /dev/null

# make test: everything but the multi-process / Ray-cluster tests marked slow (pyproject.toml), which
# make test-slow runs; CI (.ci/run) runs both. TEST_WORKERS pytest-xdist processes share the files (a file's tests
# stay in one process: its module fixtures are built once): most tests use one core, so on the 2-core machine 2
# workers took 12.7 minutes where one took 22.8 (2026-12-07). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
test: $(BIN)/.installed
	@[[ "$(TEST_WORKERS)" =~ ^([0-9]+|auto)$$ ]] || { echo "make test: TEST_WORKERS=$(TEST_WORKERS): expected a \
	number of pytest-xdist processes (0 = all tests in one process) or auto (one per core)" >&2; exit 2; }
	$(BIN)/python -m pytest -x -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" tests

test-slow: $(BIN)/.installed
	$(BIN)/python -m pytest -x -q -m slow tests

# The import-layering contracts (pyproject's [tool.importlinter]) with lint-imports' report, as make test checks them
# (tests/test_import_layers.py): over a link tree laid out as the installed package. A plain `lint-imports` in the
# checkout fails ("module gemray.kernels does not exist"): kernels/ and pipelines/ are mapped into the package by
# pyproject's package-dir, outside the gemray/ folder it walks. ARGS go to lint-imports, e.g. ARGS="--contract layers".
lint-imports: $(BIN)/.installed
	$(BIN)/python tests/test_import_layers.py $(ARGS)

clean:
	rm -rf $(VENV) runs data .pytest_cache
