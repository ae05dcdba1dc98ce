#!/usr/bin/env bash
# One short call on a one-GPU machine (device tool): formulas served by the weights in
# the tree (`models/formula/default`), shipped plan, at 128 and 256 in flight. Two calls
# on one warm machine, the weights swapped in the tree between them, compare two models
# on the same card (the tree cannot carry both).
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_weights.sh COMMIT WEIGHTS   (WEIGHTS: a label, e.g. run19)
COMMIT=${1:?usage: bash bench/device/formula_weights.sh COMMIT WEIGHTS}
WEIGHTS=${2:?weights label}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-200}))
source bench/device/step.sh
prepare "$COMMIT-$WEIGHTS" .whl
step 01-served 190 60 python3 -m bench.compare --data /tmp/b --max-batch-size 128 \
    --duration 10 --warmup 2 --client-processes 4 --out $OUT/served.jsonl \
    --servers texel --concurrency 128,256
summarize '^\||ready on|Error|error'
