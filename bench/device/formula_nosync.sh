#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool), after admission stopped
# synchronizing (index_fill_/index_copy_ instead of `t[index] = scalar`): the stream
# alone (bench.stream_probe, no HTTP, with the synchronization check), then Texel
# (4 HTTP processes, continuous batching) at 1, 128 and 256, LitServe, model-only and
# texel-nobatch side by side, then the equivalence check. Results come back under $OUT.
#   carry: .whl .whlb .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_nosync.sh COMMIT
COMMIT=$1 RESULTS=h200-nosync.jsonl
source bench/device/serving_call.sh
echo "=== stream_probe at $(( $(date +%s) - T0 ))s" >> $L
timeout 150 python3 -m bench.stream_probe --data /tmp/b --concurrency 128,256 --duration 8 \
    --max-batch-size 256 --sync-check --out $OUT/stream-probe.jsonl >> $L 2>&1
export TEXEL_HTTP_PROCESSES=4
cmp --servers texel --concurrency 1,128,256 --py-spy-at 128
unset TEXEL_HTTP_PROCESSES
cmp --servers litserve --concurrency 128
cmp --servers model-only,texel-nobatch --concurrency 128
echo "=== equivalence at $(( $(date +%s) - T0 ))s" >> $L
timeout 150 python3 -m bench.equivalence --data /tmp/b --images 500 --batch-size 128 \
    --out $OUT/equivalence.jsonl >> $L 2>&1
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
