#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): does the stream's admission cost
# depend on how many width groups a join holds? The stream alone (bench.stream_probe,
# with the device time of joins and runs) at bucket widths 64 (the default), 128 and
# 256 px, then Texel served at 128 and 256 px buckets (64 px was measured by
# formula_step.sh at 55c415f). Results come back under $OUT.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_buckets.sh COMMIT
COMMIT=$1 RESULTS=h200-buckets.jsonl
source bench/device/serving_call.sh
for WIDTH in 64 128 256; do
    echo "=== stream_probe bucket width $WIDTH at $(( $(date +%s) - T0 ))s" >> $L
    timeout 100 python3 -m bench.stream_probe --data /tmp/b --concurrency 128,256 --duration 8 \
        --max-batch-size 256 --bucket-width $WIDTH --out $OUT/stream-probe.jsonl >> $L 2>&1
done
export TEXEL_HTTP_PROCESSES=4
for WIDTH in 256 128; do
    export TEXEL_FORMULA__BUCKET_WIDTH=$WIDTH
    cmp --servers texel --concurrency 128,256
done
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
