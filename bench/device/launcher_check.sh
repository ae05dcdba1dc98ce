#!/usr/bin/env bash
# One call on a GPU machine (device tool): `texel serve` with 2 HTTP processes on the GPU,
# whether its launcher maps libtorch once ready (it should not: app/devices.py) and what
# each process holds; then Texel served at 1 and 128 in flight, 4 HTTP processes.
# Results: $OUT/bench.log and the bench.compare records in $OUT/$RESULTS.
#   carry: .whl .whlb .gb (bench/device/bundle.sh); the image model moved out of the tree
#   command: [QUICK=1] bash bench/device/launcher_check.sh COMMIT  (QUICK: the start only)
COMMIT=${1:?usage: bash bench/device/launcher_check.sh COMMIT} RESULTS=h100.jsonl
source bench/device/serving_call.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $L
TEXEL_HTTP_PROCESSES=2 TEXEL_IMAGE__ENABLED=false python3 -m app.cli serve --port 8123 \
    > $OUT/serve.log 2>&1 &
P=$!
python3 - >> $L 2>&1 <<'PY'
import time, urllib.request
start = time.monotonic()
while time.monotonic() - start < 180:
    try:
        if urllib.request.urlopen("http://127.0.0.1:8123/readyz", timeout=2).status == 200:
            break
    except Exception:
        pass
    time.sleep(0.5)
print(f"/readyz 200 after {time.monotonic() - start:.1f} s")
PY
echo "launcher maps of libtorch: $(grep -c libtorch /proc/$P/maps)" >> $L
ps -o pid,rss,time,comm -p $P --ppid $P >> $L
ps -o pid,rss,time,comm --ppid "$(pgrep -P $P -f forkserver | head -1)" >> $L 2>&1
kill -TERM $P; wait $P; echo "serve rc $?" >> $L
export TEXEL_HTTP_PROCESSES=4
[ -n "$QUICK" ] || cmp --servers texel --concurrency 1,128
echo "=== all done at $(( $(date +%s) - T0 ))s" >> $L
cat $L
