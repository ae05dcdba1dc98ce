#!/usr/bin/env bash
# One call on a one-GPU machine (device tool): can served Texel carry what the engine
# alone does at 256 in flight (about 2,160 formulas/s with batches of 256 on an H200,
# bench/RESULTS.md, tenth session) once it has the HTTP processes for it? With batches of
# 256 and 8 HTTP processes the served rate varied from 1,430 to 1,837 between loads, and
# the loads that fell short were those whose requests waited longest in `preprocess`,
# which is most of an HTTP process's CPU. First bench.equivalence on the benchmark's 500
# images, which names each answer that differs and compares streamed with batched
# answers: as shipped, with no batch bucket under 8 rows, and with cuBLAS reducing bf16
# products in float32 only (no reduced-precision split-K). Then served loads at 256 in
# flight, twice each in alternating order as time allows: batches of at most 128 or 256,
# 8 or 12 HTTP processes (TEXEL_HTTP_PROCESSES; the default is min(8, cores / 2)); each
# record says how many cores each HTTP process and the engine used.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_scale.sh COMMIT
COMMIT=${1:?usage: bash bench/device/formula_scale.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-585}))
source bench/device/step.sh
prepare "$COMMIT" .whl
COMPARE="python3 -m bench.compare --data /tmp/b --duration 10 --warmup 2 --client-processes 4
    --servers texel --concurrency 256 --out $OUT/scale.jsonl"
EQUIVALENCE="python3 -m bench.equivalence --data /tmp/b --images 500 --batch-size 128
    --out $OUT/equivalence.jsonl"
step 01-equivalence 100 50 $EQUIVALENCE
# The smallest batch bucket 8 instead of 1 (edited in the device's copy, then put back):
# do rows decoded alone part from batched ones only through the one-row graphs' kernels?
# (On the CPU, which pads no rows, 500 of 500 are identical.)
FILE=models/formula/fast_decode.py
cp $FILE /tmp/fast_decode.py
sed -i 's/^    size = 1$/    size = 8/' $FILE
grep -q '^    size = 8$' $FILE && TEXEL_COMMIT=$COMMIT-bucket8 step 02-equivalence-bucket8 100 50 \
    $EQUIVALENCE
cp /tmp/fast_decode.py $FILE
# cuBLAS may reduce a split-K product in bf16; with that off, do the one-row and the
# batched kernels still round apart?
mkdir -p /tmp/nored
echo 'import torch; torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False' \
    > /tmp/nored/sitecustomize.py
PYTHONPATH=/tmp/nored:$PYTHONPATH TEXEL_COMMIT=$COMMIT-fp32-reduction \
    step 03-equivalence-fp32-reduction 100 50 $EQUIVALENCE
i=3
for pass in 1 2; do
    for plan in "128 8" "256 8" "256 12" "128 12"; do
        read -r batch http <<< "$plan"
        i=$((i + 1))
        step "$(printf %02d $i)-batch$batch-http$http" 75 50 env TEXEL_HTTP_PROCESSES="$http" \
            $COMPARE --max-batch-size "$batch"
    done
done
summarize '^\||identical|ready on|Error|error'
