#!/usr/bin/env bash
# Continue the shipped formula model on one GPU of a device call, in the background of
# the call's benchmarks; the model and log come back under $OUT as fm.tar.* and train.log.
# Expects the wheels installed and the data unpacked at /tmp/d (the calling script does).
#   usage: [INIT=DIR] [TAG=NAME] bash bench/device/formula_train.sh GPU MINUTES
#          [LR [REAL_FRACTION [SEED [EXTRA...]]]]
#   EXTRA: more train.py options, e.g. --grow-decoder-to 6 (with --cycles N, the mean of
#   every cycle's end comes back too, as fm-mean beside fm in the same tar)
#   INIT: the model continued (the shipped one); TAG: the names under $OUT (fm: fm.tar.*,
#   train.log, formula.jsonl; any other: TAG.tar.*, TAG.log, TAG.jsonl)
GPU=$1 MINUTES=$2 LR=${3:-3e-4} REAL=${4:-0.3} SEED=${5:-8}
shift $(( $# < 5 ? $# : 5 ))
T0=$(date +%s)
INIT=${INIT:-models/formula/default} TAG=${TAG:-fm}
LOG=$OUT/$([ "$TAG" = fm ] && echo train || echo "$TAG").log
JSONL=$OUT/$([ "$TAG" = fm ] && echo formula || echo "$TAG").jsonl
(
    set -x
    rm -rf /tmp/formula.jsonl /tmp/fm-cycle*
    CUDA_VISIBLE_DEVICES=$GPU timeout $(python3 -c "print(int($MINUTES * 60 + 150))") \
        python3 -m training.formula.train \
        --data /tmp/d/im2latex-val --init-from "$INIT" --out /tmp/fm \
        --steps 100000 --max-minutes "$MINUTES" --batch-size 256 --lr "$LR" --warmup 100 \
        --real-fraction "$REAL" --eval-every 0 --dev-limit 256 --workers 18 --seed "$SEED" \
        --log /tmp/formula.jsonl "$@"
    echo "train rc=$? after $(( $(date +%s) - T0 ))s"
    cp /tmp/formula.jsonl "$JSONL"
    # Two models fit what a call brings back (64 MiB); three do not. So with --cycles the
    # cycle ends are averaged here with the end, and the end and that mean come back.
    cycles=$(ls -d /tmp/fm-cycle* 2>/dev/null)
    rm -rf /tmp/fm-mean
    [ -z "$cycles" ] || python3 -m training.formula.average --out /tmp/fm-mean $cycles /tmp/fm
    tar cf - -C /tmp fm $([ -z "$cycles" ] || echo fm-mean) | split -b 15m - "$OUT/$TAG.tar."
) > "$LOG" 2>&1
