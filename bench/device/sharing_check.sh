#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): both models in one Texel with the
# shipped sharing policy (`priority`: the formula model's stream at the highest priority,
# the image model's confined to a green context that leaves RESERVED_SMS to it), then the
# formula model's batched and streamed answers against one-at-a-time answers.
#   1. bench.mixed: the shipped formula model and an SD-1.5-size pipeline (random weights,
#      512x512, 20 steps, batches of at most 8) at 0+8, 16+8, 128+0 and 128+8 clients (16+8
#      early: its formula share is then against the 128+0 of this call, computed after);
#   2. bench.equivalence: 500 im2latex images, batches of 128.
# Logs and records go to $OUT/r, packed into $OUT/results.tar.xz; within 320 s.
#   carry: .whl .whlx .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/sharing_check.sh COMMIT
COMMIT=${1:?usage: bash bench/device/sharing_check.sh COMMIT}
T0=$(date +%s)
END=$((T0 + 320))
source bench/device/step.sh
prepare "$COMMIT" .whl .whlx
FINAL=$OUT
OUT=$OUT/r
mkdir -p $OUT
L=$OUT/bench.log
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" >> $L 2>&1

step 01-mixed 230 120 python3 -m bench.mixed --data /tmp/b --model-dir /tmp/sd15 --size sd15 \
    --steps 20 --max-batch-size 128 --image-batch-size 8 --client-processes 4 \
    --image-client-processes 1 --duration 20 --warmup 3 --out $OUT/h200-mixed.jsonl \
    --loads 0+8,16+8,128+0,128+8
grep -h -E "green context|SMs" /tmp/texel-test-*.log | sort | uniq -c | head >> $OUT/01-mixed.log
step 02-equivalence 90 50 python3 -m bench.equivalence --data /tmp/b --images 500 \
    --batch-size 128 --out $OUT/equivalence.jsonl

echo "=== all done at $(($(date +%s) - T0))s" >> $L
summarize '^(\||GPU:)|ready on|green|SMs|equal|identical'
cd $FINAL && tar cJf results.tar.xz r && rm -rf r
