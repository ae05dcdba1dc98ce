#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): where a decoding step's time goes
# at a full stream (bench.step_profile: step time, the same with the source buffers
# trimmed to the admitted rows' longest source, and a torch.profiler table of an eager
# step), the stream alone (bench.stream_probe), then the side-by-side comparison at
# concurrency 1, 128 and 256 and the equivalence check, all with the shipped formula
# model (run 12). Results come back under $OUT.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_step.sh COMMIT
COMMIT=$1 RESULTS=h200-step.jsonl
source bench/device/serving_call.sh
echo "=== step_profile at $(( $(date +%s) - T0 ))s" >> $L
timeout 150 python3 -m bench.step_profile --data /tmp/b --rows 128 >> $L 2>&1
echo "=== stream_probe at $(( $(date +%s) - T0 ))s" >> $L
timeout 120 python3 -m bench.stream_probe --data /tmp/b --concurrency 128,256 --duration 8 \
    --max-batch-size 256 --out $OUT/stream-probe.jsonl >> $L 2>&1
comparison
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
