#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): step-level batching of images against
# whole batches. SD-1.5 size (random weights, 512x512, 20 steps, fp16, eager), batches of at
# most 8: the raw pipeline at batch 1 and 8; Texel with its shipped settings (a continuous
# denoising loop) closed-loop at concurrency 1, 8 and 16 and Poisson arrivals at 3 and 5
# images/s; then the same with TEXEL_IMAGE__ADVANCED__CONTINUOUS=false (whole batches, the
# shipped 20 ms wait); then bench.image_equivalence (PSNR of 100 joined images against each
# alone, peak memory per image at 512, 768 and 1024). Results under $OUT.
#   carry: .whl .whlx (bench/device/bundle.sh)
#   command: bash bench/device/image_stream.sh COMMIT
COMMIT=$1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl $(compgen -G '.whlb/*.whl') .whlx/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TEXEL_COMMIT=$COMMIT
L=$OUT/bench.log
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> $L
image() {
    echo "=== image $* at $(( $(date +%s) - T0 ))s" >> $L
    timeout 240 python3 -m bench.compare_image --size sd15 --steps 20 \
        --duration 15 --warmup 5 --client-processes 4 --skip-nobatch --model-dir /tmp/sd15 \
        --repeats 2 --out $OUT/h200-image-stream.jsonl "$@" >> $L 2>&1 \
        || { echo "rc=$?"; tail -40 "$(ls -t /tmp/texel-test-*.log | head -1)"; } >> $L
}
image --batch-sizes 1,8 --full-load --rates 3,5
TEXEL_IMAGE__ADVANCED__CONTINUOUS=false image --batch-sizes 8 --rates 3,5
echo "=== equivalence at $(( $(date +%s) - T0 ))s" >> $L
timeout 200 python3 -m bench.image_equivalence --model-dir /tmp/sd15 --prompts 100 \
    --steps 20 --out $OUT/image-equivalence.jsonl >> $L 2>&1 || echo "rc=$?" >> $L
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
