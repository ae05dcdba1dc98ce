#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): the engine issue's bars with the
# shipped settings, and where the image engine's time goes.
#   1. bench.compare_image: SD-1.5 size (random weights, 512x512, 20 steps, fp16, eager),
#      the raw pipeline at batch 1 and 8, then Texel (continuous denoising loop, batches of
#      at most 8) closed-loop at concurrency 1 and 8, with py-spy on every process at both;
#   2. bench.compare texel: formulas served (shipped plan, batches of at most 128) at 128
#      and 256;
#   3. bench.compare engine-only: the engine's continuous decoder fed preprocessed images
#      from memory at 128, 256 and 512 in flight;
#   4. bench.compare litserve at 128 (the same adapter behind LitServe).
# Each step's output goes to $OUT/NN-name.log, records to $OUT/*.jsonl, profiles to
# $OUT/py-spy-*.txt; a step that fails or runs out of time keeps what it measured and the
# next one runs. The whole call stays within 530 s.
#   carry: .whl .whlb .whlx .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/engine_check.sh COMMIT
COMMIT=${1:?usage: bash bench/device/engine_check.sh COMMIT}
T0=$(date +%s)
END=$((T0 + 530))
source bench/device/step.sh
prepare "$COMMIT" .whl .whlx
L=$OUT/bench.log
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv \
    > $OUT/00-gpu.log 2>&1

IMAGES="python3 -m bench.compare_image --size sd15 --steps 20 --duration 15 --warmup 5
    --client-processes 4 --skip-nobatch --model-dir /tmp/sd15 --repeats 2
    --out $OUT/h200-image.jsonl"
FORMULAS="python3 -m bench.compare --data /tmp/b --max-batch-size 128 --duration 10 --warmup 2
    --client-processes 4 --out $OUT/h200-engine.jsonl"

step 01-images 200 120 $IMAGES --batch-sizes 1,8 --py-spy-at 1,8
step 02-formulas 120 70 $FORMULAS --servers texel --concurrency 128,256
step 03-engine-only 130 60 $FORMULAS --servers engine-only --concurrency 128,256,512
step 04-litserve 90 60 $FORMULAS --servers litserve --concurrency 128

echo "=== all done at $(($(date +%s) - T0))s" >> $L
summarize '^(\||GPU:|\{)|ready on'
