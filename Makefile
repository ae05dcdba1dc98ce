# Texel: make targets are the interface for humans and CI.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.texel-installed
LOCK    := deploy/constraints.txt
HOST    ?= 0.0.0.0
PORT    ?= 8000
DATA    ?= ../shared/data

# Without CUDA, torch pinned to the version the tests passed with; with nvidia-smi
# present, the default build from the index. PyPI's Linux torch is the CUDA build (a few
# GB): on a machine without a GPU, TORCH_INDEX=https://download.pytorch.org/whl/cpu
# adds PyTorch's own index, whose 2.13.0+cpu pip then prefers (the rest from PyPI).
HAVE_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
ifeq ($(HAVE_CUDA),yes)
TORCH_SPEC ?= torch
else
TORCH_SPEC ?= torch==2.13.0
endif
TORCH_INDEX ?=

.PHONY: install lock run test lint format docs bench bench-cpu bench-gpu eval-formula eval-image train-formula train-image clean

install: $(STAMP)

# pip compiles every module it installs; keep it so: where PYTHONDONTWRITEBYTECODE is
# set (CI's machine), nothing compiled at import time is kept, and every server process
# the tests start would compile torch again.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(LOCK) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -c $(LOCK) -e ".[dev]"
	touch $(STAMP)

# The versions every install takes (this one, CI's, the image's): those of the
# environment the tests passed in. After a dependency changes: install it, test, lock.
lock:
	{ echo "# The versions make install and the image install (pip -c): written by make lock."; \
	  $(PY) -m pip freeze --exclude-editable | sed -E 's/\+[a-z0-9.]+$$//'; } > $(LOCK)

# Installs only where nothing is installed yet: serving needs no network, and a newer
# pyproject.toml or lock waits for `make install` (or `make test`).
run: $(if $(wildcard $(STAMP)),,install)
	$(VENV)/bin/texel serve --host $(HOST) --port $(PORT)

# Two workers, each taking whole test files (a file's servers are module fixtures): most
# tests wait on servers and sockets, so two keep a 2-core machine busy. The longest files
# go first (conftest.py's LONGEST_FIRST), in that order.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The configuration reference is generated from app/settings.py; tests fail while it is stale.
docs: install
	$(PY) -m app.config_doc > docs/configuration.md.tmp
	mv docs/configuration.md.tmp docs/configuration.md

bench: bench-cpu

bench-cpu: install
	$(PY) -m bench.cpu

# Texel vs Texel without batching vs LitServe vs the bare model, on this machine's GPU.
bench-gpu: install
	$(VENV)/bin/pip install --quiet -e ".[dev,bench]"
	$(PY) -m bench.equivalence --data $(DATA) --images 500 --batch-size 128 --out bench/results/equivalence.jsonl
	$(PY) -m bench.compare --data $(DATA) --concurrency 1,8,32,128,256 --duration 10 --warmup 2 \
		--max-batch-size 128 --client-processes 4
	$(PY) -m bench.compare_image --size sd15 --batch-sizes 1,4,8 --steps 20 --full-load

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# The default models. Training needs a GPU (see training/*/NOTES.md for the runs behind
# the shipped weights); evaluation runs anywhere.
eval-formula: install
	$(VENV)/bin/pip install --quiet -e ".[dev,train]"  # matplotlib, for mathtext styles
	$(PY) -m training.formula.evaluate --data $(DATA)/im2latex-val --model models/formula/default --served --dtype auto --latency --by-length
	$(PY) -m training.formula.evaluate --data $(DATA)/im2latex-val --model models/formula/default --served --dtype auto --variants --limit 120
	$(PY) -m training.formula.evaluate --school $(DATA)/k12-formulas --model models/formula/default --dtype auto

eval-image: install
	$(PY) -m training.image.evaluate --model models/image/default

train-formula: install
	$(VENV)/bin/pip install --quiet -e ".[dev,train]"
	$(PY) -m training.formula.train --data $(DATA)/im2latex-val --out models/formula/default \
		--steps 100000 --max-minutes 7.9 --batch-size 256 --lr 8e-4 --real-fraction 0.3 \
		--eval-every 1500 --seed 0 --log formula-train.jsonl

train-image: install
	$(VENV)/bin/pip install --quiet -e ".[dev,train]"
	$(PY) -m training.image.train --out models/image/default
