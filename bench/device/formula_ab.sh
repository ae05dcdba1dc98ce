#!/usr/bin/env bash
# One call on a one-GPU machine (device tool): served formulas at 256 in flight (batches
# of at most BATCH, 256 unless set; 12 HTTP processes), the tree's code against an older
# commit's, in turns (tree, old, old, tree) on one machine with the same weights (the
# tree's). The older code is carried as .old: `git archive OLD app batching bench engine
# models telemetry tests conftest.py pyproject.toml | tar -x -C .old`, the models' default
# folders left out.
# Records in $OUT/ab.jsonl; each server's warnings in its step's log (`step`).
#   carry: .whl .gb .old (bench/device/bundle.sh); the image model moved out of the tree
#   command: [CALL_S=S] [BATCH=N] bash bench/device/formula_ab.sh COMMIT OLD
COMMIT=${1:?usage: bash bench/device/formula_ab.sh COMMIT OLD} OLD=${2:?old commit}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-300}))
source bench/device/step.sh
prepare "$COMMIT" .whl
# Read unquoted inside `bash -c`, where its newline only separates words.
export ARGS="--data /tmp/b --duration 10 --warmup 2 --client-processes 4 --concurrency 256
    --max-batch-size ${BATCH:-256} --servers texel --model $PWD/models/formula/default
    --out $OUT/ab.jsonl"
served() {  # served NAME DIR LABEL
    TEXEL_COMMIT=$3 step "$1" 75 60 bash -c \
        'cd "$0" && PYTHONPATH=/tmp/site:$PWD exec python3 -m bench.compare $ARGS' "$2"
}
# Tree, old, old, tree: a drift over the call (the host warming up, as the call of
# 2026-12-07 showed: each turn faster than the last) weighs on both codes alike.
served 1-tree . "$COMMIT"
served 2-old .old "$OLD"
served 3-old .old "$OLD"
served 4-tree . "$COMMIT"
summarize '^\||WARNING|ready on|Error|error'
