#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): Texel (4 HTTP processes) with
# formula batches waiting 0, 25 or 50 ms for the finished batch's clients to come back
# (TEXEL_FORMULA__MAX_REJOIN_MS), then LitServe, model-only and texel-nobatch, then the
# batched-against-alone equivalence check, all in one call on one GPU. Each record
# names its TEXEL_ settings; results come back under $OUT.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_rejoin.sh COMMIT
COMMIT=$1 RESULTS=h200-rejoin.jsonl
source bench/device/serving_call.sh
export TEXEL_HTTP_PROCESSES=4
TEXEL_FORMULA__MAX_REJOIN_MS=0 cmp --servers texel --concurrency 128,256
TEXEL_FORMULA__MAX_REJOIN_MS=25 cmp --servers texel --concurrency 1,32,128,256
TEXEL_FORMULA__MAX_REJOIN_MS=50 cmp --servers texel --concurrency 128,256
unset TEXEL_HTTP_PROCESSES
cmp --servers litserve,model-only,texel-nobatch --concurrency 128
echo "=== equivalence at $(( $(date +%s) - T0 ))s" >> $L
timeout 120 python3 -m bench.equivalence --data /tmp/b --images 500 --batch-size 128 \
    --out $OUT/equivalence.jsonl >> $L 2>&1
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
