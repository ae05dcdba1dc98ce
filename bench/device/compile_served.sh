#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool), after compile_step.sh: the served
# formula path with the decoding step compiled, at COMMIT. This copy of the tree only:
# the adapter's StaticGreedyDecoder(...) is given compile_step=True first
# (`compile_served_step`).
#   1. bench.equivalence: 500 formulas in batches of 128 and streamed, against one at a time;
#   2. bench.compare texel at 128 and 256 in flight, batches of at most 128 (the shipped plan).
# Logs and records under $OUT; within about 300 s.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/compile_served.sh COMMIT
COMMIT=${1:?usage: bash bench/device/compile_served.sh COMMIT}
T0=$(date +%s)
END=$((T0 + 300))
source bench/device/step.sh
prepare "$COMMIT-compiled" .whl
compile_served_step
step 01-equivalence 110 60 python3 -m bench.equivalence --data /tmp/b --images 500 \
    --batch-size 128 --out $OUT/equivalence.jsonl
step 02-formulas 170 100 python3 -m bench.compare --data /tmp/b --duration 10 --warmup 2 \
    --client-processes 4 --out $OUT/h200.jsonl --max-batch-size 128 --servers texel \
    --concurrency 128,256
summarize '^(\||\{)|ready on|identical|differ|Error|error'
