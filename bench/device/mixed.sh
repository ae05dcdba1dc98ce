#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): how formulas and images share one GPU,
# and the formula model's own ceiling there.
#   1. bench.mixed with TEXEL_ADVANCED__GPU_SHARING=priority (the default): one Texel with
#      the shipped formula model (batches of at most 128) and an SD-1.5-size pipeline
#      (random weights, 512x512, 20 steps, batches of at most 8), shipped plan otherwise;
#      closed-loop formula clients over 4 processes and image clients in 1, at 128+0, 0+8,
#      128+8 and 16+8 clients, 20 s each after 3 s of warm-up;
#   2. the same with the sharing off (every model on the default stream, as before), at
#      128+8 and 16+8 (its shares of the alone figures come from step 1);
#   3. bench.compare engine-only: the engine's continuous decoder fed preprocessed images
#      from memory, no HTTP, 128, 256 and 512 in flight, batches of at most 128, 10 s each
#      after 2 s of warm-up (as every served formula figure before);
#   4. bench.compare texel: formulas served (shipped plan, batches of at most 128) at 128
#      and 256, client processes and durations as in 3;
# Each step's output goes to $OUT/NN-name.log (with its server's model lines, and the
# server log's tail when it fails),
# records to $OUT/h200-mixed.jsonl and $OUT/h200-engine.jsonl as each level is measured;
# a step that fails or runs out of time keeps what it measured and the next one runs. The
# whole call stays within 520 s. The tables are printed last.
#   carry: .whl .whlx .gb (bench/device/bundle.sh; .fd is not needed)
#   command: bash bench/device/mixed.sh COMMIT
set -x
COMMIT=${1:?usage: bash bench/device/mixed.sh COMMIT}
T0=$(date +%s)
END=$((T0 + 520))  # the device tool stops a command at 600 s; leave room for the transfers
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl $(compgen -G '.whlb/*.whl') .whlx/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TEXEL_COMMIT=$COMMIT
mkdir -p /tmp/b && tar xf .gb/bench_images.tar -C /tmp/b
L=$OUT/bench.log
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv \
    > $OUT/00-gpu.log 2>&1

source bench/device/step.sh

MIXED="python3 -m bench.mixed --data /tmp/b --model-dir /tmp/sd15 --size sd15 --steps 20
    --max-batch-size 128 --image-batch-size 8 --client-processes 4 --image-client-processes 1
    --duration 20 --warmup 3 --out $OUT/h200-mixed.jsonl"
FORMULAS="python3 -m bench.compare --data /tmp/b --max-batch-size 128 --duration 10 --warmup 2
    --client-processes 4 --out $OUT/h200-engine.jsonl"
export TEXEL_REQUEST_TIMEOUT_S=300

step 01-mixed-priority 280 120 $MIXED --sharing priority --loads 128+0,0+8,128+8,16+8
step 02-mixed-off 160 100 $MIXED --sharing off --loads 128+8,16+8
step 03-engine-only 120 60 $FORMULAS --servers engine-only --concurrency 128,256,512
step 04-served 110 60 $FORMULAS --servers texel --concurrency 128,256

echo "=== all done at $(($(date +%s) - T0))s" >> $L
set +x
for log in "$OUT"/0*.log; do
    echo "##### $(basename "$log")"
    grep -E '^(\||GPU:)|ready on' "$log" || tail -5 "$log"
done
cat $L
