#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): how the SMs left to the formula model
# on a shared GPU change the light mixed load. bench.mixed (the shipped formula model and
# an SD-1.5-size pipeline with random weights, 512x512, 20 steps, batches of at most 8)
#   1. as shipped (RESERVED_SMS = 8: the image model on 120 of 132 SMs) at 0+8, 16+0, 16+8;
#   2. with RESERVED_SMS = 32 (96 SMs; recorded as commit COMMIT-reserved32) at 0+8, 16+8,
#      128+0, 128+8.
# Each record has the mean time of every stage (`stage_ms`). Logs and records go to
# $OUT/r, packed into $OUT/results.tar.xz; within 420 s.
#   carry: .whl .whlx .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/sharing_split.sh COMMIT
COMMIT=${1:?usage: bash bench/device/sharing_split.sh COMMIT}
T0=$(date +%s)
END=$((T0 + 420))
source bench/device/step.sh
prepare "$COMMIT" .whl .whlx
FINAL=$OUT
OUT=$OUT/r
mkdir -p $OUT
L=$OUT/bench.log
MIXED=(python3 -m bench.mixed --data /tmp/b --model-dir /tmp/sd15 --size sd15 --steps 20
    --max-batch-size 128 --image-batch-size 8 --client-processes 4
    --image-client-processes 1 --duration 20 --warmup 3 --out $OUT/h200-mixed.jsonl)

step 01-shipped 200 120 "${MIXED[@]}" --loads 0+8,16+0,16+8
sed -i 's/^RESERVED_SMS = 8$/RESERVED_SMS = 32/' engine/sharing.py
grep -n "^RESERVED_SMS" engine/sharing.py >> $L
export TEXEL_COMMIT=$COMMIT-reserved32
step 02-reserved32 200 100 "${MIXED[@]}" --loads 0+8,16+8,128+0,128+8
git checkout engine/sharing.py 2>/dev/null
grep -h -E "green context|SMs" /tmp/texel-test-*.log | sort | uniq -c | head >> $L

echo "=== all done at $(($(date +%s) - T0))s" >> $L
summarize '^(\||GPU:)|ready on|green|SMs'
cd $FINAL && tar cJf results.tar.xz r && rm -rf r
