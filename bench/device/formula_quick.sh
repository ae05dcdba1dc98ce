#!/usr/bin/env bash
# Prepared in the sixteenth session (2026-12-06), not yet run. One call on a one-GPU
# machine (device tool): do small pictures preprocessed on the HTTP processes' event loop
# (QUICK_PIXELS = 100,000 in models/formula/adapter.py, since de07dc7) serve more
# formulas at 256 in flight than every picture handed to the thread pool (QUICK_PIXELS =
# 0, as before)? On the development CPU the HTTP processes' CPU a request fell
# (bench/RESULTS.md); on an H100 that CPU is what served formulas at 256 wait for. The
# variant is the constant edited in the device's copy of the tree (commit label
# COMMIT-pool), then put back; alternated pool, loop, pool, loop. Served Texel with
# batches of at most 256 and the default 12 HTTP processes, a closed loop at 256 and
# Poisson 1,400/s, 10 s a load after 2 s of warm-up. Records in $OUT/quick.jsonl.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: [CALL_S=S] bash bench/device/formula_quick.sh COMMIT
COMMIT=${1:?usage: bash bench/device/formula_quick.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-330}))
source bench/device/step.sh
prepare "$COMMIT" .whl
COMPARE="python3 -m bench.compare --data /tmp/b --duration 10 --warmup 2 --client-processes 4
    --max-batch-size 256 --out $OUT/quick.jsonl"
quick() {
    constant models/formula/adapter.py QUICK_PIXELS "$1"
    export TEXEL_COMMIT=$COMMIT$2
}
i=0
for variant in pool loop pool loop; do
    i=$((i + 1))
    if [[ $variant == pool ]]; then quick 0 -pool; else quick 100_000 ""; fi
    step 0$i-served-$variant 75 55 $COMPARE --servers texel --concurrency 256 --rates 1400
done
committed
summarize '^\||ready on|Error|error'
