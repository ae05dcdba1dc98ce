#!/usr/bin/env bash
# One call on an `nvidia-h200-x2` machine (device tool), as run for the README's H200
# figures: GPU 0 continues the formula model; GPU 1 runs the single-GPU comparison,
# the batched-vs-alone equivalence and Texel with each GPU default set back. Results, profiles and the model come back under $OUT
# (8 files at most).
#   carry: .whl .fd .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_gpu.sh COMMIT [MINUTES [LR [REAL_FRACTION [SEED]]]]
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TEXEL_COMMIT=$1 TEXEL_REQUEST_TIMEOUT_S=300
mkdir -p /tmp/d /tmp/b /tmp/spy && tar xJf .fd/fd.tar.xz -C /tmp/d && tar xf .gb/bench_images.tar -C /tmp/b
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
run 150 python3 -m bench.equivalence --data /tmp/b --images 500 --batch-size 128 --out $OUT/equivalence.jsonl
# What each GPU default is worth: Texel with one of them set back (records carry the env).
TEXEL_SWITCH_INTERVAL_MS=5 run 90 python3 -m bench.compare $B --servers texel --concurrency 128,256
TEXEL_PREPROCESS_PROCESSES=0 run 90 python3 -m bench.compare $B --servers texel --concurrency 128,256
# Not yet measured: the formula batches in a worker process of their own.
TEXEL_WORKER_PROCESSES=true run 90 python3 -m bench.compare $B --servers texel --concurrency 128,256
echo "=== gpu1 done at $(( $(date +%s) - T0 ))s" >> $L
for f in $OUT/py-spy-*; do [ -e "$f" ] && mv "$f" /tmp/spy/; done
tar cJf $OUT/spy.tar.xz -C /tmp/spy .
[ "$MINUTES" = 0 ] || wait $TRAIN
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
