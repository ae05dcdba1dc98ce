#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): the denoising loop with its UNet
# replayed from CUDA graphs (models/image/graphs.py).
#   0. tests/test_image_graphs.py on the GPU (graphed steps paint what eager steps paint);
#   1. bench.compare_image: SD-1.5 size (random weights, 512x512, 20 steps, fp16), the raw
#      pipeline at batch 1 and 8, then Texel closed-loop at 1, 8 and 16 and Poisson
#      arrivals at 3 and 5 images/s;
#   2. bench.mixed: the shipped formula model and the same pipeline in one Texel, at
#      128+0, 0+8, 128+8 and 16+8 clients;
#   3. bench.image_equivalence: 100 images that joined a running loop against each alone.
# Logs and records go to $OUT/r (packed into $OUT/results.tar.xz at the end; the device
# tool brings back 8 files at most); the whole call stays within 540 s.
#   carry: .whl .whlx .whlp .gb (bench/device/bundle.sh; .whlp: pytest, pluggy, iniconfig);
#   the image model moved out of the tree
#   command: bash bench/device/image_graphs.sh COMMIT
COMMIT=${1:?usage: bash bench/device/image_graphs.sh COMMIT}
T0=$(date +%s)
END=$((T0 + 540))
source bench/device/step.sh
prepare "$COMMIT" .whl .whlx .whlp
FINAL=$OUT
OUT=$OUT/r
mkdir -p $OUT
L=$OUT/bench.log
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv >> $L 2>&1

step 00-tests 100 60 python3 -m pytest -q -p no:cacheprovider tests/test_image_graphs.py
step 01-images 230 120 python3 -m bench.compare_image --size sd15 --steps 20 --duration 15 \
    --warmup 5 --client-processes 4 --skip-nobatch --model-dir /tmp/sd15 --repeats 2 \
    --out $OUT/h200-image.jsonl --batch-sizes 1,8 --full-load --rates 3,5
step 02-mixed 190 120 python3 -m bench.mixed --data /tmp/b --model-dir /tmp/sd15 --size sd15 \
    --steps 20 --max-batch-size 128 --image-batch-size 8 --client-processes 4 \
    --image-client-processes 1 --duration 20 --warmup 3 --out $OUT/h200-mixed.jsonl \
    --loads 128+0,0+8,128+8,16+8
step 03-equivalence 100 50 python3 -m bench.image_equivalence --model-dir /tmp/sd15 \
    --prompts 100 --steps 20 --sides 512 --out $OUT/image-equivalence.jsonl

echo "=== all done at $(($(date +%s) - T0))s" >> $L
summarize '^(\||GPU:)|ready on|captured|passed|failed|PSNR|psnr'
cd $FINAL && tar cJf results.tar.xz r && rm -rf r
