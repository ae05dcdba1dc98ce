#!/usr/bin/env bash
# One short call on a one-GPU machine (device tool): served formulas at 256 in flight
# with batch invariance on (TEXEL_FORMULA__ADVANCED__BATCH_INVARIANT), the shipped plan
# otherwise (batches of at most 128, the default HTTP processes): does it keep the
# engine issue's bar at 256 (at least 1,230 formulas/s)? Then as shipped if time is left.
# Records in $OUT/invariant256.jsonl.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: [CALL_S=S] bash bench/device/formula_invariant_256.sh COMMIT
COMMIT=${1:?usage: bash bench/device/formula_invariant_256.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-150}))
source bench/device/step.sh
prepare "$COMMIT" .whl
COMPARE="python3 -m bench.compare --data /tmp/b --duration 10 --warmup 2 --client-processes 4
    --servers texel --concurrency 256 --out $OUT/invariant256.jsonl"
TEXEL_COMMIT=$COMMIT-invariant TEXEL_FORMULA__ADVANCED__BATCH_INVARIANT=true \
    step 1-served-invariant 70 45 $COMPARE
TEXEL_COMMIT=$COMMIT-shipped step 2-served-shipped 70 55 $COMPARE
summarize '^\||ready on|Error|error'
