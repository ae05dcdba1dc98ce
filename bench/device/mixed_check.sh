#!/usr/bin/env bash
# One call on a one-GPU machine (device tool): formulas and images sharing the GPU, loads
# repeated to see whether the long stalls of earlier mixed calls come back now that graphs
# which replay at once are captured on streams of their own (GraphFamily).
#   1. bench.mixed, the sharing as shipped (priority): the formula model in the tree
#      (batches of at most 128) and an SD-1.5-size pipeline (random weights, 512x512,
#      20 steps, batches of at most 8); loads 128+0, 0+8, 16+8, 128+8, 16+8, 0+8;
#   2. the same with the sharing off (every model on the default stream): 128+8, 16+8.
# 20 s a load after 3 s of warm-up; records in $OUT/mixed.jsonl.
#   carry: .whl .whlx .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/mixed_check.sh COMMIT
COMMIT=${1:?usage: bash bench/device/mixed_check.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-420}))
source bench/device/step.sh
prepare "$COMMIT" .whl .whlx
MIXED="python3 -m bench.mixed --data /tmp/b --model-dir /tmp/sd15 --size sd15 --steps 20
    --max-batch-size 128 --image-batch-size 8 --client-processes 4 --image-client-processes 1
    --duration 20 --warmup 3 --out $OUT/mixed.jsonl"
step 01-mixed-priority 270 120 $MIXED --sharing priority --loads 128+0,0+8,16+8,128+8,16+8,0+8
step 02-mixed-off 140 90 $MIXED --sharing off --loads 128+8,16+8
summarize '^(\||GPU:)|ready on|Error|error'
