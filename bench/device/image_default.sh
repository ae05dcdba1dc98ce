#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): the SD-1.5-sized image benchmark
# (random weights, 512x512, 20 steps, eager) with Texel's shipped image settings: the raw
# pipeline at batch 1, 4 and 8 against Texel at concurrency 1, 4, 8 and 16 (batches of at
# most 8) and Texel without batching at 8, four client processes. Results under $OUT.
#   carry: .whl .whlx (bench/device/bundle.sh); both default models moved out of the tree
#   command: bash bench/device/image_default.sh COMMIT
COMMIT=$1
source bench/device/image_call.sh
step 520 bench.compare_image --size sd15 --batch-sizes 1,4,8 --steps 20 --duration 15 \
    --warmup 5 --full-load --client-processes 4 --out $OUT/h200-image.jsonl
