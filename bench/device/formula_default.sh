#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): the side-by-side comparison and the
# equivalence check with 128 px formula buckets, the GPU default since they served more
# in bench/device/formula_buckets.sh. Results come back under $OUT.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_default.sh COMMIT
COMMIT=$1 RESULTS=h200-default.jsonl
source bench/device/serving_call.sh
export TEXEL_HTTP_PROCESSES=4
cmp --servers texel --concurrency 1,128,256
unset TEXEL_HTTP_PROCESSES
cmp --servers litserve --concurrency 128
cmp --servers model-only,texel-nobatch --concurrency 128
echo "=== equivalence at $(( $(date +%s) - T0 ))s" >> $L
timeout 120 python3 -m bench.equivalence --data /tmp/b --images 500 --batch-size 128 \
    --out $OUT/equivalence.jsonl >> $L 2>&1
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
