#!/usr/bin/env bash
# One call on a one-GPU machine (device tool): served formulas at 256 in flight (batches
# of at most BATCH, 256 unless set; 12 HTTP processes), the tree's code against older
# code, in turns on one machine with the same weights (the tree's). Each older code is a
# folder of .old named by its label, e.g. `.old/633fc06` from `git archive 633fc06 app
# batching bench engine models telemetry tests conftest.py pyproject.toml | tar -x -C
# .old/633fc06` (the models' default folders left out), or the tree with one change.
# The turns run forwards then backwards (tree, A, B, B, A, tree), so a drift over the
# call (the host warming up: on 2026-12-07 each turn ran faster than the last) weighs
# on every code alike. Records in $OUT/ab.jsonl, each labelled by its code's folder;
# each server's warnings in its step's log (`step`).
#   carry: .whl .gb .old (bench/device/bundle.sh); the image model moved out of the tree
#   command: [CALL_S=S] [BATCH=N] bash bench/device/formula_ab.sh COMMIT
COMMIT=${1:?usage: bash bench/device/formula_ab.sh COMMIT}
dirs=(. .old/*/) labels=("$COMMIT")
[[ -d ${dirs[1]} ]] || { echo "no older code under .old/" >&2; exit 2; }
for dir in "${dirs[@]:1}"; do labels+=("$(basename "$dir")"); done
last=$((${#dirs[@]} - 1))
order=($(seq 0 $last) $(seq $last -1 0))
T0=$(date +%s)
END=$((T0 + ${CALL_S:-$((55 * ${#order[@]} + 30))}))  # about 45-55 s a turn on an H100
source bench/device/step.sh
prepare "$COMMIT" .whl
# Read unquoted inside `bash -c`, where its newline only separates words.
export ARGS="--data /tmp/b --duration 10 --warmup 2 --client-processes 4 --concurrency 256
    --max-batch-size ${BATCH:-256} --servers texel --model $PWD/models/formula/default
    --out $OUT/ab.jsonl"
served() {  # served NAME DIR LABEL
    TEXEL_COMMIT=$3 step "$1" 100 60 bash -c \
        'cd "$0" && PYTHONPATH=/tmp/site:$PWD exec python3 -m bench.compare $ARGS' "$2"
}
i=0
for c in "${order[@]}"; do
    served "$((++i))-${labels[c]}" "${dirs[c]}" "${labels[c]}"
done
summarize '^\||WARNING|ready on|Error|error'
