#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): formulas at concurrency 128 with 4
# HTTP processes (the shipped plan on 16 cores), 8, and 8 with 2 preprocessing threads
# each, to see whether the HTTP processes' interpreter locks bound the served rate.
#   carry: .whl .whlx .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_processes.sh COMMIT
COMMIT=$1 RESULTS=h200-engine.jsonl
source bench/device/serving_call.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whlx/*.whl || exit 1
TEXEL_HTTP_PROCESSES=4 cmp --servers texel --concurrency 128
TEXEL_HTTP_PROCESSES=8 cmp --servers texel --concurrency 128
TEXEL_HTTP_PROCESSES=8 TEXEL_ADVANCED__PREPROCESS_THREADS=2 cmp --servers texel --concurrency 128
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
