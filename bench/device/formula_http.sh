#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): Texel with 1, 2, 4 and 6 HTTP
# processes (TEXEL_HTTP_PROCESSES) against LitServe with 1 and 4 HTTP processes
# (num_api_servers), texel-nobatch and model-only, all in one call on one GPU. Each
# record names its TEXEL_ settings; results come back under $OUT.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_http.sh COMMIT [COUNTS]   (COUNTS default "1 2 4 6")
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TEXEL_COMMIT=$1 TEXEL_REQUEST_TIMEOUT_S=300
mkdir -p /tmp/b && tar xf .gb/bench_images.tar -C /tmp/b
L=$OUT/bench.log
B="--data /tmp/b --duration 10 --warmup 2 --client-processes 4 --max-batch-size 128 --out $OUT/h200-http.jsonl"
cmp() {
    echo "=== $* at $(( $(date +%s) - T0 ))s" >> $L
    timeout 200 python3 -m bench.compare $B "$@" >> $L 2>&1 \
        || { echo "rc=$?"; tail -40 "$(ls -t /tmp/texel-test-*.log | head -1)"; } >> $L
}
for n in ${2:-1 2 4 6}; do
    TEXEL_HTTP_PROCESSES=$n cmp --servers texel --concurrency 128,256
done
cmp --servers litserve,litserve-4,model-only,texel-nobatch --concurrency 128
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
nproc >> $L
