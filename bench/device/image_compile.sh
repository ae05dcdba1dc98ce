#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): the SD-1.5-sized image benchmark
# with the UNet compiled (`TEXEL_IMAGE__COMPILE=batch`): the raw pipeline eager and
# compiled at batch 1 and 8, Texel at concurrency 1, 8 and 16 (batches of at most 8).
# Results come back under $OUT.
#   carry: .whl .whlx (bench/device/bundle.sh); both default models moved out of the tree
#   command: bash bench/device/image_compile.sh COMMIT
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl .whlx/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TEXEL_COMMIT=$1 PYTHONUNBUFFERED=1
L=$OUT/bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
timeout 520 python3 -m bench.compare_image --size sd15 --batch-sizes 1,8 --steps 20 \
    --duration 15 --warmup 5 --full-load --compile batch --skip-nobatch --out $OUT/h200-image.jsonl >> $L 2>&1
echo "=== rc=$? at $(( $(date +%s) - T0 ))s" >> $L
grep -h "compiled\|failed" /tmp/texel-test-*.log >> $L
