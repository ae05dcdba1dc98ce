#!/usr/bin/env bash
# One call on a one-GPU machine (device tool), after the decoder's look every 4 steps
# (CHECK_EVERY = 4, from the seventeenth session): the engine alone at 256 in flight
# (batches of at most 256), then both models sharing the GPU as shipped (priority):
# the formula model in the tree (batches of at most 128) and an SD-1.5-size pipeline
# (random weights, 512x512, 20 steps, batches of at most 8), loads 128+0, 0+8, 16+8,
# 128+8, 16+8, 0+8, 20 s each after 3 s of warm-up. Records in $OUT/check4.jsonl and
# $OUT/mixed.jsonl.
#   carry: .whl .whlx .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: [CALL_S=S] bash bench/device/formula_check4.sh COMMIT
COMMIT=${1:?usage: bash bench/device/formula_check4.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-360}))
source bench/device/step.sh
prepare "$COMMIT" .whl .whlx
step 01-engine-only 60 40 python3 -m bench.compare --data /tmp/b --duration 10 --warmup 2 \
    --client-processes 4 --max-batch-size 256 --servers engine-only --concurrency 256 \
    --out $OUT/check4.jsonl
step 02-mixed 280 120 python3 -m bench.mixed --data /tmp/b --model-dir /tmp/sd15 --size sd15 \
    --steps 20 --max-batch-size 128 --image-batch-size 8 --client-processes 4 \
    --image-client-processes 1 --duration 20 --warmup 3 --out $OUT/mixed.jsonl \
    --sharing priority --loads 128+0,0+8,16+8,128+8,16+8,0+8
summarize '^(\||GPU:)|ready on|Error|error'
