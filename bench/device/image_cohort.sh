#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): why Texel's image batches at
# concurrency 8 (as many clients as a batch holds) held 6.3 images on average. The
# SD-1.5-sized pipeline, eager, batches of at most 8, at concurrency 4 and 8: one client
# process against four (each answer is a megabyte of JSON, which one process reads one
# at a time), and the rejoin window at its default (100 ms) against 250 ms.
# Results come back under $OUT.
#   carry: .whl .whlx (bench/device/bundle.sh); both default models moved out of the tree
#   command: bash bench/device/image_cohort.sh COMMIT
COMMIT=$1
source bench/device/image_call.sh
run() {
    step 170 bench.compare_image --size sd15 --batch-sizes 4,8 --steps 20 --duration 15 \
        --warmup 5 --skip-nobatch --repeats 2 --model-dir /tmp/sd15 \
        --out $OUT/h200-image.jsonl "$@"
}
run --client-processes 1
run --client-processes 4
TEXEL_IMAGE__MAX_REJOIN_MS=250 run --client-processes 4
TEXEL_IMAGE__MAX_REJOIN_MS=250 run --client-processes 1
