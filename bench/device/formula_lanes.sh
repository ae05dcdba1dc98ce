#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): concurrent admission (each join's
# width groups encoded on lanes of their own, beside the steps already queued) against
# serial admission in the stream alone (bench.stream_probe, with its sync check), then
# the equivalence check and the side-by-side comparison with the new default. Results
# come back under $OUT.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_lanes.sh COMMIT
COMMIT=$1 RESULTS=h200-lanes.jsonl
source bench/device/serving_call.sh
echo "=== stream_probe at $(( $(date +%s) - T0 ))s" >> $L
timeout 150 python3 -m bench.stream_probe --data /tmp/b --concurrency 128,256 --duration 8 \
    --max-batch-size 256 --admission serial,concurrent --sync-check \
    --out $OUT/stream-probe.jsonl >> $L 2>&1
comparison
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
