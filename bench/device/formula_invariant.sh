#!/usr/bin/env bash
# One call on a one-GPU machine (device tool): batch invariance
# (TEXEL_FORMULA__ADVANCED__BATCH_INVARIANT: every decoding step runs all the slots and
# every encoding 8 rows) against the shipped buckets. On the GPU 499 of 500 answers decoded
# one at a time equal the batched ones as shipped (bench/RESULTS.md): rows run alone use
# the one-row graphs, batched rows the 128-row ones, whose products sum in another order,
# and a near tie flips. bench.equivalence on the benchmark's 500 images with it, then
# served loads at 1, 8 and 128 in flight with it and as shipped, in alternating order as
# time allows: what it costs.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: [CALL_S=S] bash bench/device/formula_invariant.sh COMMIT
COMMIT=${1:?usage: bash bench/device/formula_invariant.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-570}))
source bench/device/step.sh
prepare "$COMMIT" .whl
step 1-equivalence-invariant 100 50 python3 -m bench.equivalence --data /tmp/b --images 500 \
    --batch-size 128 --batch-invariant --out $OUT/equivalence.jsonl
COMPARE="python3 -m bench.compare --data /tmp/b --duration 8 --warmup 2 --client-processes 4
    --servers texel --concurrency 1,8,128 --out $OUT/invariant.jsonl"
i=1
for which in invariant shipped shipped invariant; do
    i=$((i + 1))
    flag=false
    [[ $which == invariant ]] && flag=true
    TEXEL_COMMIT=$COMMIT-$which TEXEL_FORMULA__ADVANCED__BATCH_INVARIANT=$flag \
        step "$i-served-$which" 75 60 $COMPARE
done
summarize '^\||identical|ready on|Error|error'
