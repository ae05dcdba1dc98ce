#!/usr/bin/env bash
# One call on a one-GPU machine (device tool): what a join's encodings cost, and three
# ways to make the stream faster. First one encoding of 1-12 rows at each width bucket
# (`bench.step_profile --encoder-sweep`), with the model's own encoder and with
# `FusedEncoder`. Then, batches of 256 at 256 in flight, the stream alone
# (`bench.stream_probe`: encoder rows real and padded, the lanes' device time) and served
# Texel (closed loop and Poisson 1,400/s), as committed (encoder buckets growing by
# ENCODER_BUCKET_GROWTH = 2, a look every CHECK_EVERY = 4 steps, FUSED_ENCODER = False)
# against the fused encoder (fewer kernels an encoding), encoder buckets growing by 1.5
# (less padding in a join's width groups) and a look every 2 steps (a finished row idles
# half as long): the constants edited in the device's copy, then put back. Records in
# $OUT/encoder.jsonl, the variant in each record's commit (COMMIT-growthG-checkN-fusedF).
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: [CALL_S=S] bash bench/device/formula_encoder.sh COMMIT
COMMIT=${1:?usage: bash bench/device/formula_encoder.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-570}))
source bench/device/step.sh
prepare "$COMMIT" .whl
i=0
variant() {  # variant GROWTH CHECK FUSED
    constant models/formula/fast_decode.py ENCODER_BUCKET_GROWTH $1
    constant models/formula/fast_decode.py CHECK_EVERY $2
    constant models/formula/fast_decode.py FUSED_ENCODER $3
    export TEXEL_COMMIT=$COMMIT-growth$1-check$2-fused$3
    i=$((i + 1))
    N=$(printf %02d $i)
}
for V in "2 4 False" "2 4 True"; do
    variant $V
    step $N-encoder-sweep-$TEXEL_COMMIT 45 30 python3 -m bench.step_profile --data /tmp/b \
        --encoder-sweep 1,2,3,5,8,12 --repeats 30 --out $OUT/encoder.jsonl
done
for V in "2 4 False" "2 4 True" "1.5 4 False" "2 2 False" "2 4 False" "2 4 True"; do
    variant $V
    step $N-probe-$TEXEL_COMMIT 50 30 python3 -m bench.stream_probe --data /tmp/b \
        --concurrency 256 --max-batch-size 256 --duration 8 --out $OUT/encoder.jsonl
done
for V in "2 4 False" "2 4 True"; do
    variant $V
    step $N-served-$TEXEL_COMMIT 70 55 python3 -m bench.compare --data /tmp/b --duration 10 \
        --warmup 2 --client-processes 4 --servers texel --max-batch-size 256 \
        --concurrency 256 --rates 1400 --out $OUT/encoder.jsonl
done
committed
summarize '^\||ready on|Error|error|throughput_rps|ms_by_rows'
