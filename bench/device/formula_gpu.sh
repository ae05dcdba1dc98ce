#!/usr/bin/env bash
# One call on an `nvidia-h200-x2` machine (device tool), as run for the README's H200
# figures: GPU 0 continues the formula model (formula_train.sh) while GPU 1 runs the
# single-GPU comparison; then Texel on both GPUs. Results and the model come back under $OUT.
#   carry: .whl .whlb .fd .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_gpu.sh COMMIT [MINUTES [LR [REAL_FRACTION [SEED [EXTRA...]]]]]
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl $(compgen -G '.whlb/*.whl') || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TEXEL_COMMIT=$1 TEXEL_REQUEST_TIMEOUT_S=300
mkdir -p /tmp/d /tmp/b && tar xJf .fd/fd.tar.xz -C /tmp/d && tar xf .gb/bench_images.tar -C /tmp/b
MINUTES=${2:-7.0}  # 0: no training (a one-GPU machine: benchmarks only, on GPU 0)
[ "$MINUTES" = 0 ] && BENCH_GPU=0 || BENCH_GPU=1
[ "$MINUTES" = 0 ] || bash bench/device/formula_train.sh 0 "$MINUTES" "${@:3}" &
TRAIN=$!
L=$OUT/bench.log
B="--data /tmp/b --duration 10 --warmup 2 --client-processes 4 --max-batch-size 128 --out $OUT/h200.jsonl"
run() {
    echo "=== $* at $(( $(date +%s) - T0 ))s" >> $L
    timeout "$@" >> $L 2>&1 || { echo "rc=$?"; tail -30 "$(ls -t /tmp/texel-test-*.log | head -1)"; } >> $L
}
export CUDA_VISIBLE_DEVICES=$BENCH_GPU
run 300 python3 -m bench.compare $B --servers texel,model-only,litserve --concurrency 1,8,32,128,256
run 120 python3 -m bench.compare $B --servers texel-nobatch --concurrency 1,128
echo "=== gpu1 done at $(( $(date +%s) - T0 ))s" >> $L
[ "$MINUTES" = 0 ] || {
    wait $TRAIN
    # Both GPUs, once training has finished: one worker per GPU, one serving process.
    export CUDA_VISIBLE_DEVICES=0,1
    run 100 python3 -m bench.compare ${B/h200.jsonl/h200-x2.jsonl} --servers texel --concurrency 128,256
}
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
