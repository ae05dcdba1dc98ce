#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool), after the stream started queueing
# each run before harvesting the one before: Texel (4 HTTP processes, continuous
# batching) at 1, 128 and 256 with py-spy at 128, LitServe, model-only and texel-nobatch
# side by side, then the equivalence check (batched, and streamed with random arrivals,
# against one at a time). Results and profiles come back under $OUT.
#   carry: .whl .whlb .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_ahead.sh COMMIT
COMMIT=$1 RESULTS=h200-ahead.jsonl
source bench/device/serving_call.sh
export TEXEL_HTTP_PROCESSES=4
cmp --servers texel --concurrency 1,128,256 --py-spy-at 128
unset TEXEL_HTTP_PROCESSES
cmp --servers litserve --concurrency 128
cmp --servers model-only,texel-nobatch --concurrency 128
echo "=== equivalence at $(( $(date +%s) - T0 ))s" >> $L
timeout 150 python3 -m bench.equivalence --data /tmp/b --images 500 --batch-size 128 \
    --out $OUT/equivalence.jsonl >> $L 2>&1
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
