#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): formulas served with the shipped
# settings (4 HTTP processes, one engine, the recognition cache off as in every benchmark)
# at concurrency 128, 256 and 128 again, batches of at most 128, then the equivalence
# check of 500 formulas (batched and streamed against one at a time). Results under $OUT.
#   carry: .whl .whlx .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_check.sh COMMIT
COMMIT=$1 RESULTS=h200-engine.jsonl
source bench/device/serving_call.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whlx/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> $L
export TEXEL_HTTP_PROCESSES=4
cmp --servers texel --concurrency 128,256,128
echo "=== equivalence at $(( $(date +%s) - T0 ))s" >> $L
timeout 150 python3 -m bench.equivalence --data /tmp/b --images 500 --batch-size 128 \
    --out $OUT/equivalence.jsonl >> $L 2>&1 || echo "rc=$?" >> $L
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
