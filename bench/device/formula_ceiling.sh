#!/usr/bin/env bash
# One short call on a one-GPU machine (device tool): formulas served by the weights in
# the tree at 128 and 256 in flight (shipped plan), then the engine alone at 256
# (`bench.compare` engine-only: its continuous decoder fed preprocessed inputs from
# memory), both with batches of at most 128. The engine-only step dumps every thread's
# stack if it has not finished after ENGINE_S (90) s, the way it stopped once on an H100.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_ceiling.sh COMMIT WEIGHTS   (WEIGHTS: a label)
COMMIT=${1:?usage: bash bench/device/formula_ceiling.sh COMMIT WEIGHTS}
WEIGHTS=${2:?weights label}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-300}))
source bench/device/step.sh
prepare "$COMMIT-$WEIGHTS" .whl
COMPARE="python3 -m bench.compare --data /tmp/b --max-batch-size 128 --duration 10
    --warmup 2 --client-processes 4"
step 01-served 190 60 $COMPARE --out $OUT/served.jsonl --servers texel --concurrency 128,256
ENGINE_S=${ENGINE_S:-90}
step 02-engine-only $((ENGINE_S + 10)) 40 env PYTHONFAULTHANDLER=1 timeout -s ABRT $ENGINE_S \
    $COMPARE --out $OUT/engine.jsonl --servers engine-only --concurrency 256
summarize '^\||ready on|Error|error|^Thread|^Current thread|File '
