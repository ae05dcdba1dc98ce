#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): the batcher's return tracking
# (`ReturnRate`) with real clients: the SD-1.5-sized pipeline, eager, shipped settings,
# Texel at concurrency 8 (closed loop, four client processes), then Poisson arrivals of
# 3 and 5 images/s. Results come back under $OUT.
#   carry: .whl .whlx (bench/device/bundle.sh); both default models moved out of the tree
#   command: bash bench/device/image_returns.sh COMMIT
COMMIT=$1
source bench/device/image_call.sh
step 200 bench.compare_image --size sd15 --batch-sizes 8 --steps 20 --duration 15 \
    --warmup 5 --skip-nobatch --repeats 2 --client-processes 4 --rates 3,5 \
    --out $OUT/h200-image.jsonl
grep -h "batcher" /tmp/texel-test-*.log >> $L
