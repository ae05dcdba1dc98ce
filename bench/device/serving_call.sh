# Sourced by the serving benchmark calls (formula_http.sh and the like): installs the
# carried wheels, unpacks the benchmark images and defines `cmp ARGS...`, one
# bench.compare run whose records go to $OUT/$RESULTS and whose log to $OUT/bench.log,
# and `comparison`, the whole side-by-side comparison plus the equivalence check.
#   expects: COMMIT and RESULTS set; carry .whl .whlb .gb (bench/device/bundle.sh)
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl $(compgen -G '.whlb/*.whl') || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TEXEL_COMMIT=$COMMIT TEXEL_REQUEST_TIMEOUT_S=300
mkdir -p /tmp/b && tar xf .gb/bench_images.tar -C /tmp/b
L=$OUT/bench.log
B="--data /tmp/b --duration 10 --warmup 2 --client-processes 4 --max-batch-size 128 --out $OUT/$RESULTS"
cmp() {
    echo "=== $* at $(( $(date +%s) - T0 ))s" >> $L
    timeout 200 python3 -m bench.compare $B "$@" >> $L 2>&1 \
        || { echo "rc=$?"; tail -40 "$(ls -t /tmp/texel-test-*.log | head -1)"; } >> $L
}
# The side-by-side comparison at 128 (Texel also at 1 and 256, with 4 HTTP processes),
# then the equivalence check of 500 formulas.
comparison() {
    export TEXEL_HTTP_PROCESSES=4
    cmp --servers texel --concurrency 1,128,256
    unset TEXEL_HTTP_PROCESSES
    cmp --servers litserve --concurrency 128
    cmp --servers model-only,texel-nobatch --concurrency 128
    echo "=== equivalence at $(( $(date +%s) - T0 ))s" >> $L
    timeout 120 python3 -m bench.equivalence --data /tmp/b --images 500 --batch-size 128 \
        --out $OUT/equivalence.jsonl >> $L 2>&1
}
