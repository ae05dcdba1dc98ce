#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): the formula decoding step compiled
# by torch.compile (`StaticGreedyDecoder(compile_step=True)`) against the step as it is,
# at COMMIT.
#   1. bench.step_profile --sweep: a step's time at 64, 128 and 256 rows, as it is;
#   2. the same compiled at 256 rows, with how many rows decode to the same tokens as
#      uncompiled (compiling is slow: its warm-up time is in bench/RESULTS.md);
#   3. bench.compare engine-only at 256 in flight, batches of at most 256, as it is;
#   4. the same with the served decoder compiled: this copy of the tree only, the
#      adapter's StaticGreedyDecoder(...) given compile_step=True (`compile_served_step`).
# Logs and records under $OUT; within CALL_S seconds (default 560); the engine-only pair
# runs only when both fit.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/compile_step.sh COMMIT
COMMIT=${1:?usage: bash bench/device/compile_step.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-560}))
source bench/device/step.sh
prepare "$COMMIT" .whl
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $L 2>&1
SWEEP="python3 -m bench.step_profile --data /tmp/b --repeats 50 --out $OUT/steps.jsonl"
step 01-step-sweep 50 30 $SWEEP --sweep 64,128,256
step 02-step-sweep-compiled 150 120 $SWEEP --sweep 256 --compile
COMPARE="python3 -m bench.compare --data /tmp/b --duration 10 --warmup 2
    --client-processes 4 --out $OUT/engine.jsonl --max-batch-size 256
    --servers engine-only --concurrency 256"
step 03-engine-only 100 320 $COMPARE
compile_served_step
export TEXEL_COMMIT=$COMMIT-compiled
step 04-engine-only-compiled 220 200 $COMPARE
summarize '^(\||\{)|ready on|identical|differ|Error|error'
