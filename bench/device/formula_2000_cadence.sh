#!/usr/bin/env bash
# One call on a one-GPU machine (device tool): the GPU issue's 2,000 formulas/s at 256 in
# flight (batches of at most 256, 12 HTTP processes, the aiohttp clients of fb04984 and the
# cheaper preprocessing of 295c06a), with the decoder looking at its rows every 8 steps
# (CHECK_EVERY as committed) and every 4 (the constant edited in the device's copy of the
# tree, then put back). The engine alone at 256 for each, then served Texel at 256 closed
# loop and Poisson 1,400/s, alternated 8, 4, 8, 4. Records in $OUT/2000.jsonl, the variant
# in each record's commit (COMMIT-checkN).
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: [CALL_S=S] bash bench/device/formula_2000_cadence.sh COMMIT
COMMIT=${1:?usage: bash bench/device/formula_2000_cadence.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-440}))
source bench/device/step.sh
prepare "$COMMIT" .whl
COMPARE="python3 -m bench.compare --data /tmp/b --duration 10 --warmup 2 --client-processes 4
    --max-batch-size 256 --out $OUT/2000.jsonl"
FILE=models/formula/fast_decode.py
cp $FILE /tmp/fast_decode.py
cadence() {
    sed -i "s/^CHECK_EVERY = [0-9]*$/CHECK_EVERY = $1/" $FILE
    grep -q "^CHECK_EVERY = $1$" $FILE || { echo "no CHECK_EVERY in $FILE" >> $L; exit 1; }
    export TEXEL_COMMIT=$COMMIT-check$1
}
i=0
for N in 8 4; do
    i=$((i + 1))
    cadence $N
    step 0$i-engine-only-check$N 60 40 $COMPARE --servers engine-only --concurrency 256
done
for N in 8 4 8 4; do
    i=$((i + 1))
    cadence $N
    TEXEL_HTTP_PROCESSES=12 step 0$i-served-check$N 80 65 $COMPARE --servers texel \
        --concurrency 256 --rates 1400
done
cp /tmp/fast_decode.py $FILE
summarize '^\||ready on|Error|error'
