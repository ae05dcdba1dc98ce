#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): why Texel's image batches at
# concurrency 8 (as many clients as a batch holds) held 6.3-6.8 images on average. The
# SD-1.5-sized pipeline, eager, batches of at most 8: the rejoin window at its default
# (100 ms) against 250 and 500 ms, four client processes; then one client process
# (each answer is a megabyte of JSON, which one process reads one at a time). Each
# Texel record carries its stage times from /metrics. Results come back under $OUT.
#   carry: .whl .whlx (bench/device/bundle.sh); both default models moved out of the tree
#   command: bash bench/device/image_cohort.sh COMMIT
COMMIT=$1
source bench/device/image_call.sh
run() {
    step ${LIMIT:-140} bench.compare_image --size sd15 --steps 20 --duration 15 --warmup 5 \
        --skip-nobatch --repeats 2 --model-dir /tmp/sd15 --out $OUT/h200-image.jsonl "$@"
}
LIMIT=170 run --batch-sizes 4,8 --client-processes 4
TEXEL_IMAGE__MAX_REJOIN_MS=250 LIMIT=170 run --batch-sizes 4,8 --client-processes 4
TEXEL_IMAGE__MAX_REJOIN_MS=500 run --batch-sizes 8 --client-processes 4
run --batch-sizes 8 --client-processes 1
