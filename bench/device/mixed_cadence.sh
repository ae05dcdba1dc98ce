#!/usr/bin/env bash
# Prepared in the seventeenth session (2026-12-06), not yet run. One call on a one-GPU
# machine (device tool): on a GPU serving both models, the formula stream looking every
# 8 steps (SHARED_CHECK_EVERY as committed) against every 4 (the constant edited in the
# device's copy, then put back), both models sharing as shipped (priority): the formula
# model in the tree (batches of at most 128) and an SD-1.5-size pipeline (random weights,
# 512x512, 20 steps, batches of at most 8), loads 128+0, 0+8, 16+8, 128+8 for each (or
# LOADS), 20 s each after 3 s of warm-up; the first half is the shipped rule, so this
# call also checks the mixed figures as shipped. Does a formula load beside an idle image
# model gain from looks every 4 (as formula-only GPUs do), and what do the images keep at
# 16 + 8?
# Records in $OUT/mixed.jsonl, the variant in each record's commit (COMMIT-sharedN).
#   carry: .whl .whlx .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: [CALL_S=S] [LOADS=A+B,...] bash bench/device/mixed_cadence.sh COMMIT
COMMIT=${1:?usage: bash bench/device/mixed_cadence.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-480}))
LOADS=${LOADS:-128+0,0+8,16+8,128+8}
CAP=$((80 + 30 * $(tr ',' '\n' <<< "$LOADS" | wc -l)))  # server start-up and 23 s a load
source bench/device/step.sh
prepare "$COMMIT" .whl .whlx
i=0
for N in 8 4; do
    constant models/formula/fast_decode.py SHARED_CHECK_EVERY $N
    export TEXEL_COMMIT=$COMMIT-shared$N
    i=$((i + 1))
    step 0$i-mixed-shared$N $CAP 90 python3 -m bench.mixed --data /tmp/b --model-dir /tmp/sd15 \
        --size sd15 --steps 20 --max-batch-size 128 --image-batch-size 8 --client-processes 4 \
        --image-client-processes 1 --duration 20 --warmup 3 --out $OUT/mixed.jsonl \
        --sharing priority --loads $LOADS
done
committed
summarize '^(\||GPU:)|ready on|Error|error'
