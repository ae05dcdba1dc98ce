#!/usr/bin/env bash
# One call on a one-GPU machine (device tool): are answers batch-invariant once every
# decoding step and every encoding runs at one batch shape? On the GPU 499 of 500 answers
# decoded one at a time equal the batched ones (bench/RESULTS.md, eleventh session): rows
# run alone use the one-row graphs, batched rows the 128-row ones, whose products sum in
# another order, and a near-tie flips; a smallest bucket of 8 rows did not help. Here the
# device's copy is edited so that the only batch bucket is the largest (every step and
# every encoding padded to it), then bench.equivalence on the benchmark's 500 images, as
# shipped and so edited; then served loads at 1, 8 and 128 in flight, as shipped and so
# edited, twice each in alternating order: what the one shape costs a lone request.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_invariant.sh COMMIT
COMMIT=${1:?usage: bash bench/device/formula_invariant.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-570}))
source bench/device/step.sh
prepare "$COMMIT" .whl
FILE=models/formula/fast_decode.py
cp $FILE /tmp/fast_decode.py
variant() {  # shipped | one-shape
    cp /tmp/fast_decode.py $FILE
    if [[ $1 == one-shape ]]; then
        sed -i 's/^    size = 1$/    size = max_batch_size/' $FILE
        grep -q '^    size = max_batch_size$' $FILE || { echo "no bucket line" >> $L; exit 1; }
    fi
}
EQUIVALENCE="python3 -m bench.equivalence --data /tmp/b --images 500 --batch-size 128
    --out $OUT/equivalence.jsonl"
COMPARE="python3 -m bench.compare --data /tmp/b --duration 8 --warmup 2 --client-processes 4
    --servers texel --concurrency 1,8,128 --out $OUT/invariant.jsonl"
i=0
for which in shipped one-shape; do
    variant $which
    i=$((i + 1))
    TEXEL_COMMIT=$COMMIT-$which step "$i-equivalence-$which" 100 50 $EQUIVALENCE
done
for which in one-shape shipped shipped one-shape; do
    variant $which
    i=$((i + 1))
    TEXEL_COMMIT=$COMMIT-$which step "$i-served-$which" 90 60 $COMPARE
done
cp /tmp/fast_decode.py $FILE
summarize '^\||identical|ready on|Error|error'
