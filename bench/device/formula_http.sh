#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): Texel with 1, 2, 4 and 6 HTTP
# processes (TEXEL_HTTP_PROCESSES) against LitServe with 1 and 4 HTTP processes
# (num_api_servers), texel-nobatch and model-only, all in one call on one GPU. Each
# record names its TEXEL_ settings; results come back under $OUT.
#   carry: .whl .whlb .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_http.sh COMMIT [COUNTS]   (COUNTS default "1 2 4 6")
COMMIT=$1 RESULTS=h200-http.jsonl
source bench/device/serving_call.sh
for n in ${2:-1 2 4 6}; do
    TEXEL_HTTP_PROCESSES=$n cmp --servers texel --concurrency 128,256
done
cmp --servers litserve,litserve-4,model-only,texel-nobatch --concurrency 128
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
nproc >> $L
