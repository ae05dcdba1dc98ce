#!/usr/bin/env bash
# One call on a one-GPU machine (device tool): what a join's encodings cost, and whether
# finer encoder buckets pay. First one encoding of 1-27 rows at each width bucket
# (`bench.step_profile --encoder-sweep`); then the stream alone at 256 in flight
# (`bench.stream_probe`, batches of 256: encoder rows real and padded, the lanes' device
# time) and served Texel at 256 (closed loop and Poisson 1,400/s), with encoder buckets
# growing by 1.5 (ENCODER_BUCKET_GROWTH as committed) and by 2 (powers of two, as before;
# the constant edited in the device's copy, then put back), alternated 2, 1.5, 2, 1.5 for
# the stream and 2, 1.5 served. Records in $OUT/encoder.jsonl, the variant in each
# record's commit (COMMIT-growthG).
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: [CALL_S=S] bash bench/device/formula_encoder.sh COMMIT
COMMIT=${1:?usage: bash bench/device/formula_encoder.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-480}))
source bench/device/step.sh
prepare "$COMMIT" .whl
step 01-encoder-sweep 60 40 python3 -m bench.step_profile --data /tmp/b \
    --encoder-sweep 1,2,3,5,8,12,18,27 --repeats 50 --out $OUT/encoder.jsonl
i=1
for G in 2 1.5 2 1.5; do
    constant models/formula/fast_decode.py ENCODER_BUCKET_GROWTH $G
    export TEXEL_COMMIT=$COMMIT-growth$G
    i=$((i + 1))
    step 0$i-probe-growth$G 60 40 python3 -m bench.stream_probe --data /tmp/b \
        --concurrency 256 --max-batch-size 256 --duration 10 --out $OUT/encoder.jsonl
done
for G in 2 1.5; do
    constant models/formula/fast_decode.py ENCODER_BUCKET_GROWTH $G
    export TEXEL_COMMIT=$COMMIT-growth$G
    i=$((i + 1))
    step 0$i-served-growth$G 75 55 python3 -m bench.compare --data /tmp/b --duration 10 \
        --warmup 2 --client-processes 4 --servers texel --max-batch-size 256 \
        --concurrency 256 --rates 1400 --out $OUT/encoder.jsonl
done
committed
summarize '^\||ready on|Error|error|throughput_rps|ms_by_rows'
