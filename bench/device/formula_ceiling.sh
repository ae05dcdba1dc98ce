#!/usr/bin/env bash
# One short call on a one-GPU machine (device tool): the engine alone at 128 and 256 in
# flight (`bench.compare` engine-only: its continuous decoder fed preprocessed inputs
# from memory), then formulas served by the weights in the tree at 128 and 256 (shipped
# plan), both with batches of at most 128. The engine-only step dumps every thread's
# stack if it has not finished after ENGINE_S (90) s, the way it stopped on an H100
# before graphs that replay at once were captured on streams of their own.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_ceiling.sh COMMIT WEIGHTS   (WEIGHTS: a label)
#   BATCH (128) sets the largest batch, CONCURRENCY (128,256) the loads.
COMMIT=${1:?usage: bash bench/device/formula_ceiling.sh COMMIT WEIGHTS}
WEIGHTS=${2:?weights label}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-300}))
source bench/device/step.sh
prepare "$COMMIT-$WEIGHTS" .whl
COMPARE="python3 -m bench.compare --data /tmp/b --max-batch-size ${BATCH:-128} --duration 10
    --warmup 2 --client-processes 4"
ENGINE_S=${ENGINE_S:-90}
step 01-engine-only $((ENGINE_S + 10)) 40 env PYTHONFAULTHANDLER=1 timeout -s ABRT $ENGINE_S \
    $COMPARE --out $OUT/engine.jsonl --servers engine-only --concurrency ${CONCURRENCY:-128,256}
step 02-served 190 110 $COMPARE --out $OUT/served.jsonl --servers texel --concurrency ${CONCURRENCY:-128,256}
summarize '^\||ready on|Error|error|^Thread|^Current thread|File '
