#!/usr/bin/env bash
# One short call on an `nvidia-h200` machine (device tool): Texel served at concurrency
# 128 and 256 with each stage's p99 and the server's own request p99 read from /metrics
# (bench.compare's stage_p99_ms), to see where the latency tail is. Results come back
# under $OUT.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_tail.sh COMMIT
COMMIT=$1 RESULTS=h200-tail.jsonl
source bench/device/serving_call.sh
export TEXEL_HTTP_PROCESSES=4
cmp --servers texel --concurrency 128,256
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
