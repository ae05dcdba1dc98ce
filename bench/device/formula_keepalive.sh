#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool), after the load generator keeps every
# client's connection alive: Texel (4 HTTP processes) with continuous batching and
# without, LitServe, texel-nobatch and model-only, side by side at 128 and 256.
# Results and the servers' logs come back under $OUT.
#   carry: .whl .whlb .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_keepalive.sh COMMIT
COMMIT=$1 RESULTS=h200-keepalive.jsonl
source bench/device/serving_call.sh
export TEXEL_HTTP_PROCESSES=4
cmp --servers texel --concurrency 128,256
TEXEL_FORMULA__CONTINUOUS=false cmp --servers texel --concurrency 128,256
unset TEXEL_HTTP_PROCESSES
cmp --servers litserve --concurrency 128,256
cmp --servers model-only,texel-nobatch --concurrency 128
for f in /tmp/texel-test-*.log; do grep -v "uvicorn.access" "$f" | tail -c 100000 > "$OUT/$(basename "$f")"; done
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
