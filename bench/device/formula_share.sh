#!/usr/bin/env bash
# One call on a one-GPU machine (device tool): does an even share of connections over the
# HTTP processes (app.server.ConnectionShare: a process holding more than an eighth over
# its share closes a connection after its next answer) pay on the GPU? The kernel's hash
# gave the busiest of 8 HTTP processes 1.3-1.6x its share of 256 closed-loop clients on
# an H100 (bench/RESULTS.md, eleventh session), and its queue of `preprocess` set the
# tail. Served formulas, the shipped plan (12 HTTP processes on 16 cores since 600b15b),
# as committed ("share") and with the share switched off in the device's copy ("off", the
# code before it), twice each in alternating order: closed loops at 128 and 256 in flight
# and Poisson arrivals at 1,400/s with batches of at most 128 (the default), then closed
# loops at 256 with batches of at most 256. Records in $OUT/share.jsonl.
#   carry: .whl .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/formula_share.sh COMMIT
COMMIT=${1:?usage: bash bench/device/formula_share.sh COMMIT}
T0=$(date +%s)
END=$((T0 + ${CALL_S:-590}))
source bench/device/step.sh
prepare "$COMMIT" .whl
FILE=app/launcher.py
cp $FILE /tmp/launcher.py
COMPARE="python3 -m bench.compare --data /tmp/b --duration 10 --warmup 2 --client-processes 4
    --servers texel --out $OUT/share.jsonl"
variant() {  # share | off
    cp /tmp/launcher.py $FILE
    if [[ $1 == off ]]; then
        sed -i 's/^    share = ConnectionShare(connections, index)$/    share = None/' $FILE
        grep -q '^    share = None$' $FILE || { echo "no share line to switch off" >> $L; exit 1; }
    fi
}
i=0
alternate() {  # alternate LABEL CAP NEED COMPARE-ARGS...: share, off, off, share
    local label=$1 cap=$2 need=$3 which
    shift 3
    for which in share off off share; do
        variant $which
        i=$((i + 1))
        TEXEL_COMMIT=$COMMIT-$which step "$i-$which-$label" "$cap" "$need" $COMPARE "$@"
    done
}
alternate batch128 80 60 --concurrency 128,256 --rates 1400
alternate batch256 68 60 --concurrency 256 --max-batch-size 256
cp /tmp/launcher.py $FILE
summarize '^\||ready on|Error|error'
