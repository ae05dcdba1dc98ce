#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): the side-by-side comparison and the
# equivalence check with 128 px formula buckets, the GPU default since they served more
# in bench/device/formula_buckets.sh. Results come back under $OUT.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_default.sh COMMIT
COMMIT=$1 RESULTS=h200-default.jsonl
source bench/device/serving_call.sh
comparison
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
