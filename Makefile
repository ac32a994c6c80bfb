# gemray: `make demo` (set-up + data + main job on ML-1M) and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DATA_SRC ?= ../shared/data/ml-1m
OUT ?= runs/demo
DEMO_EPOCHS ?= 10
# The demo trains with per-sequence shared negatives: per-position ones (configs/ml-1m.toml, as HSTU) cost
# ~1.8x more CPU per step and would not fit the 20-minute budget on a 2-core machine.
DEMO_SET ?= model.negatives=uniform_shared

# Pinned CPU stack (see README "Install"). torch first from the CPU wheel; torchrec --no-deps because its
# metadata asks for the CUDA fbgemm-gpu, which would overwrite fbgemm-gpu-cpu (same fbgemm_gpu folder).
TORCH_PIN := torch==2.13.0
# Where the CPU torch wheel comes from. Empty = pip's configured indexes (this project's machines keep the
# CPU wheel on local disk). Elsewhere use: make demo TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
TORCH_INDEX ?=
STACK := fbgemm-gpu-cpu==1.8.0 "ray[data,train,default]==2.60.0" "pyarrow>=14" triton==3.9.0 \
	tensordict "torchmetrics==1.0.3" pyre-extensions iopath tqdm numpy matplotlib fsspec
TORCHREC := torchrec==1.8.0
TEST_DEPS := pytest jsonschema pyyaml kubernetes-validate==1.37.0 import-linter==2.17

.PHONY: venv install demo test data clean

$(BIN)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_INDEX) $(TORCH_PIN)
	$(BIN)/pip install -q $(TORCH_PIN) $(STACK) $(TEST_DEPS)
	$(BIN)/pip install -q --no-deps $(TORCHREC)
	$(BIN)/pip install -q --no-deps -e .
	touch $@

venv install: $(BIN)/.installed

# The demo's config trains MovieLens-1M from data/ml-1m: refuse another release before it overwrites that folder.
data: $(BIN)/.installed
	@test -f "$(DATA_SRC)/ratings.dat" || { echo "make data / make demo: DATA_SRC=$(DATA_SRC) holds no ratings.dat \
	(MovieLens-1M's ratings file; data/ml-1m is left as it is); for another release point a config's data.raw_dir \
	and data.prepared_dir at it (configs/ml-latest-small.toml, README \"Configuration\")" >&2; exit 2; }
	$(BIN)/gemray prepare movielens --src $(DATA_SRC) --out data/ml-1m

demo: $(BIN)/.installed data
	$(BIN)/gemray train --config configs/ml-1m.toml --set train.epochs=$(DEMO_EPOCHS) $(DEMO_SET) --output $(OUT)

test: $(BIN)/.installed
	$(BIN)/python -m pytest -x -q tests

clean:
	rm -rf $(VENV) runs data .pytest_cache
