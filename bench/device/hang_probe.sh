#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): bench.mixed through load after load
# (shipped sharing) with a watchdog. When the server has answered nothing for 15 s, every
# Python process's stacks (py-spy dump, twice, 5 s apart), nvidia-smi and the server's
# in-flight and queue gauges are written to $OUT/r; then the run is stopped. Packed into
# $OUT/results.tar.xz; within PROBE_S (320) + 10 s. LOADS replaces the loads. With
# RESERVED, engine.sharing.RESERVED_SMS is that instead (recorded as commit
# COMMIT-reservedRESERVED).
#   carry: .whl .whlb .whlx .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: bash bench/device/hang_probe.sh COMMIT [RESERVED]
COMMIT=${1:?usage: bash bench/device/hang_probe.sh COMMIT [RESERVED]}
T0=$(date +%s)
source bench/device/step.sh
prepare "$COMMIT" .whl .whlx
if [[ -n $2 ]]; then
    sed -i "s/^RESERVED_SMS = [0-9]*$/RESERVED_SMS = $2/" engine/sharing.py
    export TEXEL_COMMIT=$COMMIT-reserved$2
fi
FINAL=$OUT
OUT=$OUT/r
mkdir -p $OUT
L=$OUT/bench.log
touch /tmp/hang-probe-start  # the server's log is the one written after this
python3 -m bench.mixed --data /tmp/b --model-dir /tmp/sd15 --size sd15 --steps 20 \
    --max-batch-size 128 --image-batch-size 8 --client-processes 4 \
    --image-client-processes 1 --duration 15 --warmup 2 --out $OUT/h200-mixed.jsonl \
    --loads ${LOADS:-0+8,16+8,128+0,128+8,16+8,128+0,0+8,16+8,128+0,128+8} > $OUT/mixed.log 2>&1 &
MIXED=$!
dump() {
    local pid
    for pid in $(pgrep -f python3); do
        echo "##### pid $pid: $(tr '\0' ' ' < /proc/$pid/cmdline | cut -c1-200)"
        timeout 20 py-spy dump "$@" --pid "$pid" 2>&1
    done
}
last=-1 still=0
while kill -0 $MIXED 2>/dev/null && (($(date +%s) - T0 < ${PROBE_S:-320})); do
    sleep 3
    log=$(find /tmp -maxdepth 1 -name 'texel-test-*.log' -newer /tmp/hang-probe-start | head -1)
    [[ -n $log ]] || continue
    count=$(grep -c "POST /" "$log")
    if ((count > 0 && count == last)); then still=$((still + 3)); else still=0; fi
    last=$count
    if ((still >= 15)); then
        port=${log##*texel-test-}; port=${port%.log}
        echo "=== stall: no answer for ${still}s at $(($(date +%s) - T0))s, $count answered" >> $L
        curl -s -m 10 "http://127.0.0.1:$port/metrics" \
            | grep -E "^texel_(inflight|queue_depth|model_ready|requests_rejected)" > $OUT/metrics.txt
        nvidia-smi > $OUT/smi.txt 2>&1
        dump > $OUT/dump1.txt 2>&1
        sleep 5
        dump --native > $OUT/dump2.txt 2>&1
        nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv >> $OUT/smi.txt 2>&1
        tail -200 "$log" > $OUT/server-tail.log
        break
    fi
done
kill $MIXED 2>/dev/null; sleep 2; pkill -f "app.cli serve"; pkill -f bench.mixed
# (not `pkill -f texel`: the device call's own command line may hold that word)
echo "=== done at $(($(date +%s) - T0))s" >> $L
grep -E "^\|" $OUT/mixed.log >> $L
cat $L
cd $FINAL && tar cJf results.tar.xz r && rm -rf r
