#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): the side-by-side comparison and the
# equivalence check with the shipped code and model, then Texel at concurrency 128 with 8
# HTTP processes and with the default 4 once more (the run-to-run spread), and the model
# alone at batch 256 as well as 128. Results come back under $OUT.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_final.sh COMMIT
COMMIT=$1 RESULTS=h200-final.jsonl
source bench/device/serving_call.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> $L
comparison
export TEXEL_HTTP_PROCESSES=8
cmp --servers texel --concurrency 128
export TEXEL_HTTP_PROCESSES=4
cmp --servers texel --concurrency 128
unset TEXEL_HTTP_PROCESSES
cmp --servers model-only --concurrency 128,256 --max-batch-size 256
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
