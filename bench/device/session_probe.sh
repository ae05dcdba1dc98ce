#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): the formula bars of the engine and
# GPU scheduling issues at COMMIT, then the mixed-load watchdog for what the call has left.
#   1. bench.compare texel: formulas served (shipped plan, batches of at most 128) at 128
#      and 256 in flight;
#   2. bench.compare engine-only at 256 (the engine's decoder fed from memory);
#   3. bench.equivalence: 500 formulas batched and streamed against one at a time;
#   4. hang_probe.sh with the loads below, until the call is 560 s old.
# Logs and records under $OUT, the probe's in $OUT/results.tar.xz.
#   carry: .whl .whlx .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/session_probe.sh COMMIT
COMMIT=${1:?usage: bash bench/device/session_probe.sh COMMIT}
T0=$(date +%s)
END=$((T0 + 340))
source bench/device/step.sh
prepare "$COMMIT" .whl .whlx
FORMULAS="python3 -m bench.compare --data /tmp/b --max-batch-size 128 --duration 10 --warmup 2
    --client-processes 4 --out $OUT/h200-engine.jsonl"
step 01-formulas 140 80 $FORMULAS --servers texel --concurrency 128,256
step 02-engine-only 130 60 $FORMULAS --servers engine-only --concurrency 256
step 03-equivalence 100 40 python3 -m bench.equivalence --data /tmp/b --images 500 \
    --batch-size 128 --out $OUT/equivalence.jsonl
summarize '^(\||\{)|ready on|identical|differ'
PROBE_S=$((560 - ($(date +%s) - T0))) LOADS=${LOADS:-16+8,128+8,128+0,0+8,16+8,128+8} \
    bash bench/device/hang_probe.sh "$COMMIT"
