#!/usr/bin/env bash
# One call on a one-GPU machine (device tool): the GPU issue's bar for formulas, at least
# 2,000 formulas/s served at 256 in flight with p99 at most 300 ms and at least 80% of
# the engine alone. The engine alone first (bench.compare engine-only, batches of at most
# 256), then served loads at 256 in flight with batches of at most 256 and 12 HTTP
# processes (the default since 600b15b), three times, 8 HTTP processes between them.
# Records in $OUT/2000.jsonl; since fb04984 the clients are aiohttp's.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: [CALL_S=S] bash bench/device/formula_2000.sh COMMIT
COMMIT=${1:?usage: bash bench/device/formula_2000.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-400}))
source bench/device/step.sh
prepare "$COMMIT" .whl
COMPARE="python3 -m bench.compare --data /tmp/b --duration 10 --warmup 2 --client-processes 4
    --concurrency 256 --max-batch-size 256 --out $OUT/2000.jsonl"
step 1-engine-only 70 50 $COMPARE --servers engine-only
i=1
for http in 12 8 12 8 12; do
    i=$((i + 1))
    TEXEL_COMMIT=$COMMIT-http$http TEXEL_HTTP_PROCESSES=$http \
        step "$i-served-http$http" 70 55 $COMPARE --servers texel
done
summarize '^\||ready on|Error|error'
