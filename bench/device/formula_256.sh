#!/usr/bin/env bash
# Diagnosis call on an `nvidia-h200` machine (device tool): continuous batching at
# concurrency 256, with py-spy on the serving process and its children and the server
# logs kept; then with room for every client in the stream (max batch 256); then with
# one HTTP process. Results, profiles and logs come back under $OUT.
#   carry: .whl .whlb .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_256.sh COMMIT
COMMIT=$1 RESULTS=h200-256.jsonl
source bench/device/serving_call.sh
keep_logs() { for f in /tmp/texel-test-*.log; do tail -c 300000 "$f" > "$OUT/$1-$(basename "$f")"; rm -f "$f"; done; }
export TEXEL_HTTP_PROCESSES=4
cmp --servers texel --concurrency 256 --py-spy-at 256
keep_logs a
cmp --servers texel --concurrency 128,256 --max-batch-size 256
keep_logs b
TEXEL_HTTP_PROCESSES=1 cmp --servers texel --concurrency 256
keep_logs c
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
