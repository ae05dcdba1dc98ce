#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): the engine-per-device design against
# issue 22's bars. Formulas: Texel with its shipped settings (4 HTTP processes, one engine)
# at concurrency 1, 128 and 256, batches of at most 128, then the equivalence check of 500
# formulas (with EQUIVALENCE=1). Images (SD-1.5 size, random weights, 512x512, 20 steps, batches of at most 8):
# the raw pipeline at batch 1 and 8 against Texel at concurrency 1 and 8, with the shipped
# 20 ms wait and with 100 ms (at concurrency WAIT100_SIZES, 1 by default). Results under $OUT.
#   carry: .whl .whlx .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/engine_call.sh COMMIT
COMMIT=$1 RESULTS=h200-engine.jsonl
source bench/device/serving_call.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whlx/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> $L
cmp() {  # as serving_call.sh's, with room for the engine's warm-up, keeping its log
    echo "=== $* at $(( $(date +%s) - T0 ))s" >> $L
    timeout 420 python3 -m bench.compare $B "$@" >> $L 2>&1 || echo "rc=$?" >> $L
    cp "$(ls -t /tmp/texel-test-*.log | head -1)" $OUT/formula-server.log
}
cmp --servers texel --concurrency 1,128,256
[ -n "$EQUIVALENCE" ] && {
    echo "=== equivalence at $(( $(date +%s) - T0 ))s" >> $L
    timeout 120 python3 -m bench.equivalence --data /tmp/b --images 500 --batch-size 128 \
        --out $OUT/equivalence.jsonl >> $L 2>&1
}
image() {
    echo "=== image $* at $(( $(date +%s) - T0 ))s" >> $L
    timeout 300 python3 -m bench.compare_image --size sd15 --steps 20 \
        --duration 15 --warmup 5 --client-processes 4 --skip-nobatch --model-dir /tmp/sd15 \
        --out $OUT/h200-image-engine.jsonl "$@" >> $L 2>&1 \
        || { echo "rc=$?"; tail -40 "$(ls -t /tmp/texel-test-*.log | head -1)"; } >> $L
}
image --batch-sizes 1,8
TEXEL_IMAGE__MAX_WAIT_MS=100 image --batch-sizes ${WAIT100_SIZES:-1}
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
