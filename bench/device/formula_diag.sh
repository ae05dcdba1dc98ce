#!/usr/bin/env bash
# One call on an `nvidia-h200-x2` machine (device tool): GPU 0 continues the formula
# model; GPU 1 runs Texel once per serving setting (each record names its TEXEL_/OTEL_
# settings), with py-spy profiles (child processes included). Results, profiles and the
# model come back under $OUT (8 files at most).
#   carry: .whl .whlb .fd .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_diag.sh COMMIT [TRAIN_MINUTES]  (0: one GPU, no training)
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl $(compgen -G '.whlb/*.whl') || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TEXEL_COMMIT=$1 TEXEL_REQUEST_TIMEOUT_S=300
mkdir -p /tmp/d /tmp/b /tmp/spy && tar xJf .fd/fd.tar.xz -C /tmp/d && tar xf .gb/bench_images.tar -C /tmp/b
MINUTES=${2:-7.0}
[ "$MINUTES" = 0 ] && BENCH_GPU=0 || BENCH_GPU=1
[ "$MINUTES" = 0 ] || bash bench/device/formula_train.sh 0 "$MINUTES" 3e-4 0.3 9 &
TRAIN=$!
L=$OUT/bench.log
B="--data /tmp/b --duration 10 --warmup 2 --client-processes 4 --max-batch-size 128"
cmp() {  # cmp LABEL ARGS...: py-spy files (if any) are kept under LABEL
    local label=$1; shift
    echo "=== $label: $* at $(( $(date +%s) - T0 ))s" >> $L
    timeout 300 python3 -m bench.compare $B --out /tmp/spy/r.jsonl "$@" >> $L 2>&1 \
        || { echo "rc=$?"; tail -40 "$(ls -t /tmp/texel-test-*.log | head -1)"; } >> $L
    for f in /tmp/spy/py-spy-*; do [ -e "$f" ] && mv "$f" "/tmp/spy/$label-${f##*/py-spy-}"; done
}
export CUDA_VISIBLE_DEVICES=$BENCH_GPU
# Same call, same GPU: the shipped defaults against batches in a worker process of their
# own (TEXEL_WORKER_PROCESSES), with peers for scale and the equivalence check.
cmp default --servers texel --concurrency 128,256 --py-spy-at 128
TEXEL_WORKER_PROCESSES=true cmp workers --servers texel --concurrency 1,32,128,256 --py-spy-at 128
TEXEL_WORKER_PROCESSES=true TEXEL_PREPROCESS_PROCESSES=4 cmp workers-procs4 --servers texel \
    --concurrency 128,256
cmp peers --servers litserve,model-only,texel-nobatch --concurrency 128
echo "=== equivalence at $(( $(date +%s) - T0 ))s" >> $L
timeout 150 python3 -m bench.equivalence --data /tmp/b --images 500 --batch-size 128 \
    --out $OUT/equivalence.jsonl >> $L 2>&1
echo "=== gpu1 done at $(( $(date +%s) - T0 ))s" >> $L
cp /tmp/spy/r.jsonl $OUT/h200-diag.jsonl
tar cJf $OUT/spy.tar.xz -C /tmp/spy --exclude r.jsonl .
[ "$MINUTES" = 0 ] || wait $TRAIN
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
