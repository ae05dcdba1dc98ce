#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): the SD-1.5-sized image benchmark
# (random weights, 512x512, 20 steps): the raw pipeline at batch 1, 4 and 8 against Texel
# at concurrency 1, 4, 8 and 16 (batches of at most 8, so at 16 every batch is full), and
# Texel without batching; then the raw pipeline eager, in channels_last and compiled
# (`bench.image_unet`). Results come back under $OUT.
#   carry: .whl .whlx (bench/device/bundle.sh); both default models moved out of the tree
#   command: bash bench/device/image_final.sh COMMIT
COMMIT=$1
source bench/device/image_call.sh
step 330 bench.compare_image --size sd15 --batch-sizes 1,4,8 --steps 20 \
    --duration 15 --warmup 5 --full-load --out $OUT/h200-image.jsonl
step 80 bench.image_unet --variants eager,channels_last --out $OUT/h200-image.jsonl
step $(( 585 - $(date +%s) + T0 )) bench.image_unet --variants compile,compile+channels_last \
    --out $OUT/h200-image.jsonl
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
