#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): where the host side of the latency
# tail at concurrency 128 goes. Texel as shipped (garbage collector frozen at readiness),
# then with TEXEL_GC_FREEZE=false, with tracing off, with 8 HTTP processes instead of 4,
# and as shipped again (the run-to-run spread). Each record carries the stage p99s, the
# event loops' lag p99 and the garbage collector's pauses. Results come back under $OUT.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_gc.sh COMMIT
COMMIT=$1 RESULTS=h200-gc.jsonl
source bench/device/serving_call.sh
export TEXEL_HTTP_PROCESSES=4
cmp --servers texel --concurrency 128
TEXEL_GC_FREEZE=false cmp --servers texel --concurrency 128
OTEL_SDK_DISABLED=true cmp --servers texel --concurrency 128
TEXEL_HTTP_PROCESSES=8 cmp --servers texel --concurrency 128
cmp --servers texel --concurrency 128
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
