#!/usr/bin/env bash
# One short call on a one-GPU machine (device tool): formulas served at 128 in flight three
# times in a row (the shipped plan, batches of at most 128), for the spread of p99 / p50
# within one machine; then do batched and streamed answers still equal one-at-a-time
# answers on the benchmark's 500 images (bench.equivalence, batches of at most 128).
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_verify.sh COMMIT
COMMIT=${1:?usage: bash bench/device/formula_verify.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-300}))
source bench/device/step.sh
prepare "$COMMIT" .whl
step 01-served 150 80 python3 -m bench.compare --data /tmp/b --max-batch-size 128 \
    --duration 10 --warmup 2 --client-processes 4 --out $OUT/served.jsonl --servers texel \
    --concurrency 128,128,128
step 02-equivalence 150 60 python3 -m bench.equivalence --data /tmp/b --images 500 \
    --batch-size 128 --out $OUT/equivalence.jsonl
summarize '^\||identical|ready on|Error|error'
