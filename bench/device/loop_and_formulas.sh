#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): Texel's denoising loop against the
# diffusers pipeline in one process (bench.image_loop, SD-1.5 size, with an operator
# profile), then formulas served with the shipped settings (4 HTTP processes) at
# concurrency 128, 256 and 128 again.
#   carry: .whl .whlx .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/loop_and_formulas.sh COMMIT
COMMIT=$1 RESULTS=h200-engine.jsonl
source bench/device/serving_call.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whlx/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> $L
echo "=== image loop at $(( $(date +%s) - T0 ))s" >> $L
timeout 240 python3 -m bench.image_loop --model-dir /tmp/sd15 --batch-sizes 1,8 --steps 20 \
    --profile --out $OUT/h200-image-loop.jsonl >> $L 2>&1 || echo "rc=$?" >> $L
export TEXEL_HTTP_PROCESSES=4
cmp --servers texel --concurrency 128,256,128
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
