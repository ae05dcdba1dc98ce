#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): Texel (4 HTTP processes) with
# continuous batching (the default) and without (TEXEL_FORMULA__CONTINUOUS=false), then
# LitServe, model-only and texel-nobatch, then the equivalence check (batched, and
# streamed with random arrivals, against one at a time), all in one call on one GPU.
# Each record names its TEXEL_ settings; results come back under $OUT.
#   carry: .whl .whlb .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_continuous.sh COMMIT
COMMIT=$1 RESULTS=h200-continuous.jsonl
source bench/device/serving_call.sh
export TEXEL_HTTP_PROCESSES=4
cmp --servers texel --concurrency 1,32,128,256
TEXEL_FORMULA__CONTINUOUS=false cmp --servers texel --concurrency 128,256
unset TEXEL_HTTP_PROCESSES
cmp --servers litserve --concurrency 128,256
cmp --servers model-only,texel-nobatch --concurrency 128
echo "=== equivalence at $(( $(date +%s) - T0 ))s" >> $L
timeout 150 python3 -m bench.equivalence --data /tmp/b --images 500 --batch-size 128 \
    --out $OUT/equivalence.jsonl >> $L 2>&1
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
