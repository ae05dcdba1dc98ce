#!/usr/bin/env bash
# One call on a one-GPU machine (device tool): does the continuous formula decoder gain from
# looking at its rows more often? On CUDA it replays CHECK_EVERY decoding steps
# (models/formula/fast_decode.py) between two looks at which rows finished, and it keeps
# one run queued ahead, so a row holds its slot for about two runs besides its own steps,
# and arrivals join two runs later. Each variant is the constant edited in this copy of
# the tree (the device's), measured the same way, then put back:
#   bench.stream_probe (the stream alone at 128 and 256 in flight: host time per check by
#   phase, and the device time of the work each join and each run queues);
#   bench.compare --servers engine-only (no HTTP), closed loop at 128 and 256 in flight and
#   Poisson arrivals at 800 and 1,400 a second; then served Texel, closed loop at 128 and
#   256 (the shipped plan). Batches of at most 128, 10 s a level after 2 s of warm-up.
# Then the stream alone with width buckets of BUCKETS px (256 512; the GPU default is 128).
# Records in $OUT/cadence.jsonl and $OUT/probe.jsonl, the variant in each record's
# commit (COMMIT-checkN).
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_cadence.sh COMMIT [VARIANTS]   (VARIANTS: "8 4")
COMMIT=${1:?usage: bash bench/device/formula_cadence.sh COMMIT [VARIANTS]}
VARIANTS=${2:-8 4}
BUCKETS=${BUCKETS:-256 512}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-540}))
source bench/device/step.sh
prepare "$COMMIT" .whl
COMPARE="python3 -m bench.compare --data /tmp/b --max-batch-size 128 --duration 10
    --warmup 2 --client-processes 4 --out $OUT/cadence.jsonl"
FILE=models/formula/fast_decode.py
cp $FILE /tmp/fast_decode.py
i=0
for N in $VARIANTS; do
    i=$((i + 1))
    sed -i "s/^CHECK_EVERY = [0-9]*$/CHECK_EVERY = $N/" $FILE
    grep -q "^CHECK_EVERY = $N$" $FILE || { echo "no CHECK_EVERY in $FILE" >> $L; exit 1; }
    export TEXEL_COMMIT=$COMMIT-check$N
    step 0$i-probe-check$N 70 50 python3 -m bench.stream_probe --data /tmp/b \
        --concurrency 128,256 --duration 8 --out $OUT/probe.jsonl
    step 0$i-engine-only-check$N 110 60 env PYTHONFAULTHANDLER=1 timeout -s ABRT 100 \
        $COMPARE --servers engine-only --concurrency 128,256 --rates 800,1400
    step 0$i-served-check$N 120 80 $COMPARE --servers texel --concurrency 128,256
    cp /tmp/fast_decode.py $FILE
done
# Fewer, wider width buckets: fewer encoder replays a join, more padding in each.
for W in $BUCKETS; do
    i=$((i + 1))
    export TEXEL_COMMIT=$COMMIT-bucket$W
    step 0$i-probe-bucket$W 60 40 python3 -m bench.stream_probe --data /tmp/b \
        --concurrency 128,256 --duration 8 --bucket-width $W --out $OUT/probe.jsonl
done
summarize '^\||stream-only|ready on|Error|error|^Thread|File '
