#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): the SD-1.5-sized image benchmark
# with the UNet compiled (`TEXEL_IMAGE__COMPILE=batch`): the raw pipeline eager and
# compiled at batch 1 and 8, Texel at concurrency 1, 8 and 16 (batches of at most 8),
# four client processes. Results come back under $OUT.
#   carry: .whl .whlx (bench/device/bundle.sh); both default models moved out of the tree
#   command: bash bench/device/image_compile.sh COMMIT
COMMIT=$1
source bench/device/image_call.sh
step 560 bench.compare_image --size sd15 --batch-sizes 1,8 --steps 20 --duration 15 \
    --warmup 5 --full-load --compile batch --skip-nobatch --client-processes 4 \
    --out $OUT/h200-image.jsonl
grep -h "compiled\|failed" /tmp/texel-test-*.log >> $L
