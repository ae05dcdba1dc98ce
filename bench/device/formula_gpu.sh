#!/usr/bin/env bash
# One call on an `nvidia-h200-x2` machine (device tool), as run for the README's H200
# figures: GPU 0 continues the formula model; GPU 1 runs the single-GPU comparison and
# A/B checks (each record names its settings); then Texel on both GPUs. Results, py-spy
# samples and the model come back under $OUT: 8 files, the most a call returns.
#   carry: .whl .fd .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_gpu.sh COMMIT [TRAIN_MINUTES]
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TEXEL_COMMIT=$1 TEXEL_REQUEST_TIMEOUT_S=300
mkdir -p /tmp/d /tmp/b && tar xJf .fd/fd.tar.xz -C /tmp/d && tar xf .gb/bench_images.tar -C /tmp/b
(
    CUDA_VISIBLE_DEVICES=0 timeout 440 python3 -m models.formula.train \
        --data /tmp/d/im2latex-val --init-from models/formula/default --out /tmp/fm \
        --steps 100000 --max-minutes "${2:-6.0}" --batch-size 256 --lr 3e-4 --warmup 100 \
        --real-fraction 0.3 --eval-every 0 --dev-limit 256 --workers 18 --seed "$RANDOM" \
        --log /tmp/formula.jsonl > $OUT/train.log 2>&1
    echo "train rc=$? at $(( $(date +%s) - T0 ))s" >> $OUT/train.log
    tar cf - -C /tmp fm | split -b 15m - $OUT/fm.tar.
) &
TRAIN=$!
L=$OUT/bench.log
B="--data /tmp/b --duration 10 --warmup 2 --client-processes 4 --max-batch-size 128"
cmp() {
    echo "=== $* at $(( $(date +%s) - T0 ))s" >> $L
    timeout 420 python3 -m bench.compare $B "$@" >> $L 2>&1 \
        || { echo "rc=$?"; tail -40 "$(ls -t /tmp/texel-test-*.log | head -1)"; } >> $L
}
export CUDA_VISIBLE_DEVICES=1
cmp --servers texel,model-only,litserve,texel-nobatch --concurrency 1,8,32,128,256 --out $OUT/h200.jsonl --py-spy-at 128
TEXEL_PREPROCESS_PROCESSES=8 cmp --servers texel --concurrency 128 --out $OUT/h200.jsonl
TEXEL_PREPROCESS_THREADS=4 cmp --servers texel --concurrency 128 --out $OUT/h200.jsonl
OTEL_TRACES_SAMPLER=parentbased_traceidratio OTEL_TRACES_SAMPLER_ARG=0.01 \
    cmp --servers texel --concurrency 128 --out $OUT/h200.jsonl
echo "=== gpu1 done at $(( $(date +%s) - T0 ))s" >> $L
wait $TRAIN
unset CUDA_VISIBLE_DEVICES
cmp --servers texel --concurrency 128,256 --out $OUT/h200-x2.jsonl
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
