#!/usr/bin/env bash
# Prepared in the seventeenth session (2026-12-06), not yet run. One call on a one-GPU
# machine (device tool): both models sharing the GPU as shipped
# (priority), the formula stream looking every 8 steps on a GPU shared with the image
# model (as before the seventeenth session, now two replays of 4-step graphs; every 4
# on a GPU of its own): a check that the mixed figures hold. The formula model in the tree
# (batches of at most 128) and an SD-1.5-size pipeline (random weights, 512x512, 20
# steps, batches of at most 8), loads 128+0, 0+8, 16+8, 128+8, 16+8, 20 s each after 3 s
# of warm-up (or LOADS). Records in $OUT/mixed.jsonl.
#   carry: .whl .whlx .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: [CALL_S=S] [LOADS=A+B,...] bash bench/device/mixed_shared.sh COMMIT
COMMIT=${1:?usage: bash bench/device/mixed_shared.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-240}))
source bench/device/step.sh
prepare "$COMMIT" .whl .whlx
step 01-mixed 220 90 python3 -m bench.mixed --data /tmp/b --model-dir /tmp/sd15 --size sd15 \
    --steps 20 --max-batch-size 128 --image-batch-size 8 --client-processes 4 \
    --image-client-processes 1 --duration 20 --warmup 3 --out $OUT/mixed.jsonl \
    --sharing priority --loads ${LOADS:-128+0,0+8,16+8,128+8,16+8}
summarize '^(\||GPU:)|ready on|Error|error'
