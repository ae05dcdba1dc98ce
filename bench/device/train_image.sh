#!/usr/bin/env bash
# One call on an `nvidia-h200-x2` machine (device tool): GPU 0 continues the formula model
# (bench/device/formula_train.sh); GPU 1 runs the SD-1.5-sized image benchmark with the
# shipped defaults (batches in a worker process on a GPU) and with batches on a thread of
# the serving process, each record naming its settings.
#   carry: .whl .whlx .fd (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/train_image.sh COMMIT MINUTES [LR [REAL_FRACTION [SEED [EXTRA...]]]]
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl $(compgen -G '.whlb/*.whl') .whlx/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TEXEL_COMMIT=$1
shift
mkdir -p /tmp/d && tar xJf .fd/fd.tar.xz -C /tmp/d
bash bench/device/formula_train.sh 0 "$@" &
TRAIN=$!
L=$OUT/bench.log
export CUDA_VISIBLE_DEVICES=1
echo "=== shipped defaults at $(( $(date +%s) - T0 ))s" >> $L
timeout 240 python3 -m bench.compare_image --size sd15 --batch-sizes 1,4,8 --steps 20 \
    --duration 15 --warmup 5 --out $OUT/h200.jsonl >> $L 2>&1
echo "=== batches on a thread at $(( $(date +%s) - T0 ))s" >> $L
TEXEL_WORKER_PROCESSES=false timeout 150 python3 -m bench.compare_image --size sd15 \
    --batch-sizes 4,8 --steps 20 --duration 15 --warmup 5 --repeats 1 --out $OUT/h200.jsonl >> $L 2>&1
echo "=== bench done at $(( $(date +%s) - T0 ))s" >> $L
wait $TRAIN
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
