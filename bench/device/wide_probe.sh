#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): formulas with room in the stream
# for every client at 256 (TEXEL_FORMULA__MAX_BATCH_SIZE=256), against the shipped
# probe's batches of at most 128, at COMMIT.
#   1. bench.compare texel at 128 and 256 in flight, batches of at most 128;
#   2. bench.compare texel at 256, batches of at most 256;
#   3. bench.compare engine-only at 256, batches of at most 256;
#   4. bench.equivalence: 500 formulas in batches of 256 and streamed, against one at a time;
#   5. bench.step_profile --sweep: a decoding step's time at 32 to 256 rows.
# Logs and records under $OUT; within about 540 s.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/wide_probe.sh COMMIT
COMMIT=${1:?usage: bash bench/device/wide_probe.sh COMMIT}
T0=$(date +%s)
END=$((T0 + 540))
source bench/device/step.sh
prepare "$COMMIT" .whl
COMPARE="python3 -m bench.compare --data /tmp/b --duration 10 --warmup 2
    --client-processes 4 --out $OUT/h200-engine.jsonl"
step 01-formulas 130 60 $COMPARE --max-batch-size 128 --servers texel --concurrency 128,256
step 02-wide 100 60 $COMPARE --max-batch-size 256 --servers texel --concurrency 256
step 03-engine-only 130 60 $COMPARE --max-batch-size 256 --servers engine-only \
    --concurrency 256
step 04-equivalence 100 40 python3 -m bench.equivalence --data /tmp/b --images 500 \
    --batch-size 256 --out $OUT/equivalence.jsonl
step 05-step-sweep 60 30 python3 -m bench.step_profile --data /tmp/b \
    --sweep 32,64,96,128,160,192,256 --repeats 50
summarize '^(\||\{)|ready on|identical|differ'
