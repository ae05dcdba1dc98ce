#!/usr/bin/env bash
# One call on an `nvidia-h200-x2` machine (device tool): GPU 1 continues the image model's
# UNet and text encoder and sweeps steps x guidance; GPU 0 runs the SD-1.5-sized image
# benchmark, batched-vs-alone equivalence of the formula model, and the image benchmark
# again with worker processes.
#   carry: .whl .whlx .gb (bench/device/bundle.sh); the formula model stays in the tree
#   command: bash bench/device/image_gpu.sh COMMIT [UNET_SECONDS]
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl $(compgen -G '.whlb/*.whl') .whlx/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TEXEL_COMMIT=$1
mkdir -p /tmp/b && tar xf .gb/bench_images.tar -C /tmp/b
L=$OUT/image_train.log
(
    export CUDA_VISIBLE_DEVICES=1
    timeout 420 python3 -m training.image.train --out /tmp/im --train-images 240000 --workers 20 \
        --vae-from models/image/default/vae --vae-steps 0 --denoiser-from models/image/default \
        --unet-steps 100000 --unet-budget-s "${2:-300}" --unet-batch 1024 --unet-lr 3e-4 \
        --seed "$RANDOM" --metrics $OUT/image_metrics.json > $L 2>&1
    echo "train rc=$? at $(( $(date +%s) - T0 ))s" >> $L
    tar cf - -C /tmp im | split -b 15m - $OUT/im.tar.
    timeout 90 python3 -m training.image.evaluate --model /tmp/im --device cuda --grid 10,15:2,3 \
        --batch-size 288 --workers 16 >> $L 2>&1
) &
TRAIN=$!
export CUDA_VISIBLE_DEVICES=0
timeout 240 python3 -m bench.compare_image --size sd15 --batch-sizes 1,4,8 --steps 20 \
    --duration 15 --warmup 5 --out $OUT/h200.jsonl > $OUT/bench.log 2>&1
timeout 120 python3 -m bench.equivalence --data /tmp/b --images 500 --batch-size 128 \
    --out $OUT/equivalence.jsonl >> $OUT/bench.log 2>&1
# Not yet measured: batches in a worker process of their own (TEXEL_WORKER_PROCESSES).
TEXEL_WORKER_PROCESSES=true timeout 150 python3 -m bench.compare_image --size sd15 \
    --batch-sizes 4,8 --steps 20 --duration 15 --warmup 5 --out $OUT/h200.jsonl >> $OUT/bench.log 2>&1
echo "bench done at $(( $(date +%s) - T0 ))s" >> $OUT/bench.log
wait $TRAIN
