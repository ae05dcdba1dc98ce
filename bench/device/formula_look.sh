#!/usr/bin/env bash
# Measured at 0841195 (bench/RESULTS.md, fifteenth session), the split removed after:
# the script edits a constant that no longer exists. One call on a one-GPU machine
# (device tool): does the formula stream gain from a look
# that reads a snapshot taken part-way through its check? As committed (AHEAD_STEPS = 8
# of CHECK_EVERY = 8, models/formula/fast_decode.py) the host queues a whole run after the
# snapshot it harvests, so a row that ends keeps its slot for the rest of its run and the
# whole next one (about 12 steps), and new rows join a run later. With AHEAD_STEPS = 4 a
# check is 4 steps, a snapshot, 4 steps, then the harvest (about 8 steps), with 2 about 6;
# looks stay one every 8 steps. The variant is the constant edited in the device's copy of
# the tree (commit label COMMIT-aheadN), then put back. Batches of at most 128 (the
# default) unless BATCH is set; 10 s a load after 2 s of warm-up.
#   PART=engine: bench.stream_probe at 256 in flight (host time per phase: whether the
#     steps ahead cover the host's work), then the engine alone (bench.compare
#     --servers engine-only) closed loop at 256 and Poisson 1,400/s; variants 8, 4, 2.
#   PART=served: served Texel closed loops at 128 and 256 and Poisson 1,400/s; variants
#     8, 4, 8, 4.
# Records in $OUT/look.jsonl and $OUT/probe.jsonl.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: [BATCH=256] [CALL_S=S] bash bench/device/formula_look.sh COMMIT engine|served
COMMIT=${1:?usage: bash bench/device/formula_look.sh COMMIT engine|served}
PART=${2:?usage: bash bench/device/formula_look.sh COMMIT engine|served}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-540}))
source bench/device/step.sh
prepare "$COMMIT" .whl
BATCH=${BATCH:-128}
COMPARE="python3 -m bench.compare --data /tmp/b --duration 10 --warmup 2 --client-processes 4
    --max-batch-size $BATCH --out $OUT/look.jsonl"
FILE=models/formula/fast_decode.py
cp $FILE /tmp/fast_decode.py
ahead() {
    cp /tmp/fast_decode.py $FILE
    sed -i "s/^AHEAD_STEPS = [0-9]*$/AHEAD_STEPS = $1/" $FILE
    grep -q "^AHEAD_STEPS = $1$" $FILE || { echo "no AHEAD_STEPS in $FILE" >> $L; exit 1; }
    export TEXEL_COMMIT=$COMMIT-ahead$1
}
i=0
if [[ $PART == engine ]]; then
    for N in 8 4 2; do
        i=$((i + 1))
        ahead $N
        step 0$i-probe-ahead$N 45 30 python3 -m bench.stream_probe --data /tmp/b \
            --concurrency 256 --max-batch-size $BATCH --duration 8 --out $OUT/probe.jsonl
        step 0$i-engine-only-ahead$N 75 50 $COMPARE --servers engine-only --concurrency 256 \
            --rates 1400
    done
else
    for N in 8 4 8 4; do
        i=$((i + 1))
        ahead $N
        step 0$i-served-ahead$N 100 80 $COMPARE --servers texel --concurrency 128,256 \
            --rates 1400
    done
fi
cp /tmp/fast_decode.py $FILE
summarize '^\||stream-only|ready on|Error|error|^Thread|File '
