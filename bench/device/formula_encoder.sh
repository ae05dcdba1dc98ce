#!/usr/bin/env bash
# One call on a one-GPU machine (device tool): what a join's encodings cost, and two ways
# to free the stream's rows sooner. First one encoding of 1-27 rows at each width bucket
# (`bench.step_profile --encoder-sweep`). Then, batches of 256 at 256 in flight, the
# stream alone (`bench.stream_probe`: encoder rows real and padded, the lanes' device
# time) and served Texel (closed loop and Poisson 1,400/s), as committed (encoder buckets
# growing by ENCODER_BUCKET_GROWTH = 2, a look every CHECK_EVERY = 4 steps) against
# encoder buckets growing by 1.5 (less padding in a join's width groups) and against a
# look every 2 steps (a finished row idles half as long): the constants edited in the
# device's copy, then put back. Records in $OUT/encoder.jsonl, the variant in each
# record's commit (COMMIT-growthG-checkN).
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: [CALL_S=S] bash bench/device/formula_encoder.sh COMMIT
COMMIT=${1:?usage: bash bench/device/formula_encoder.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-540}))
source bench/device/step.sh
prepare "$COMMIT" .whl
step 01-encoder-sweep 50 30 python3 -m bench.step_profile --data /tmp/b \
    --encoder-sweep 1,2,3,5,8,12,18,27 --repeats 30 --out $OUT/encoder.jsonl
i=1
variant() {  # variant GROWTH CHECK
    constant models/formula/fast_decode.py ENCODER_BUCKET_GROWTH $1
    constant models/formula/fast_decode.py CHECK_EVERY $2
    export TEXEL_COMMIT=$COMMIT-growth$1-check$2
    i=$((i + 1))
}
for V in "2 4" "1.5 4" "2 2" "2 4" "1.5 4"; do
    variant $V
    step 0$i-probe-$TEXEL_COMMIT 50 30 python3 -m bench.stream_probe --data /tmp/b \
        --concurrency 256 --max-batch-size 256 --duration 8 --out $OUT/encoder.jsonl
done
for V in "2 4" "1.5 4" "2 2"; do
    variant $V
    step $i-served-$TEXEL_COMMIT 70 50 python3 -m bench.compare --data /tmp/b --duration 10 \
        --warmup 2 --client-processes 4 --servers texel --max-batch-size 256 \
        --concurrency 256 --rates 1400 --out $OUT/encoder.jsonl
done
committed
summarize '^\||ready on|Error|error|throughput_rps|ms_by_rows'
