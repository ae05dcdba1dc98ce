#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): the side-by-side comparison and the
# equivalence check with the shipped model, each stage's p99 and the server's own request
# p99 read from /metrics (bench.compare's stage_p99_ms) to see where the latency tail is,
# and Texel at concurrency 128 with more stream rows than clients (no request waits for
# a free row). Results come back under $OUT.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_tail.sh COMMIT
COMMIT=$1 RESULTS=h200-tail.jsonl
source bench/device/serving_call.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> $L
comparison
export TEXEL_HTTP_PROCESSES=4
cmp --servers texel --concurrency 128 --max-batch-size 192
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
