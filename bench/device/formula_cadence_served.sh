#!/usr/bin/env bash
# One call on a one-GPU machine (device tool): served Texel with the decoder looking at
# its rows every 8 steps (CHECK_EVERY as committed) and every 4 (the constant edited in
# the device's copy of the tree, then put back), now that small pictures are preprocessed
# on the event loop and served Texel runs at 98-99% of the engine alone (bench/RESULTS.md).
# Two plans, each a closed loop and Poisson arrivals: batches of at most 256 at 256 in
# flight and 1,400/s (the GPU issue's bar), and the default batches of at most 128 at 128
# in flight and 1,000/s. Alternated 8, 4, 8, 4; 12 HTTP processes (the default). Records
# in $OUT/cadence.jsonl, the variant in each record's commit (COMMIT-checkN).
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: [CALL_S=S] bash bench/device/formula_cadence_served.sh COMMIT
COMMIT=${1:?usage: bash bench/device/formula_cadence_served.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-540}))
source bench/device/step.sh
prepare "$COMMIT" .whl
COMPARE="python3 -m bench.compare --data /tmp/b --duration 10 --warmup 2 --client-processes 4
    --servers texel --out $OUT/cadence.jsonl"
i=0
for N in 8 4 8 4; do
    constant models/formula/fast_decode.py CHECK_EVERY $N
    export TEXEL_COMMIT=$COMMIT-check$N
    i=$((i + 1))
    step 0$i-256-check$N 70 55 $COMPARE --max-batch-size 256 --concurrency 256 --rates 1400
    i=$((i + 1))
    step 0$i-128-check$N 70 55 $COMPARE --max-batch-size 128 --concurrency 128 --rates 1000
done
committed
summarize '^\||ready on|Error|error'
