# Sourced by the device calls: `prepare`, their set-up, and `step`, one bounded step of a
# call (expects T0, END, L, OUT).

# prepare COMMIT FOLDER...: install the wheels carried in each FOLDER (and .whlb's where
# carried), export what the benchmarks read (the commit they record), unpack the benchmark
# images into /tmp/b, and start the call's log, L ($OUT/bench.log), with the GPU it runs on.
prepare() {
    local commit=$1 folder wheels=()
    shift
    for folder in "$@"; do wheels+=("$folder"/*.whl); done
    [[ -d .whlb ]] && wheels+=(.whlb/*.whl)  # LitServe and py-spy, where carried
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${wheels[@]}" || exit 1
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TEXEL_COMMIT=$commit
    export TEXEL_REQUEST_TIMEOUT_S=300
    mkdir -p /tmp/b && tar xf .gb/bench_images.tar -C /tmp/b
    rm -rf /tmp/committed  # `constant`'s copies, from an earlier call on a warm machine
    L=$OUT/bench.log
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$L" 2>&1
}

# summarize PATTERN: each step's log lines that match PATTERN (or its tail), then the
# call's own log; then the logs go into one archive, $OUT/logs.tar.gz (at most 8 files
# come back from a call: the records and the archive).
summarize() {
    local log
    for log in "$OUT"/[0-9]*.log; do
        echo "##### $(basename "$log")"
        grep -E "$1" "$log" | cut -c1-300
        ((PIPESTATUS[0] == 0)) || tail -5 "$log"
    done
    cat "$L"
    (cd "$OUT" && tar czf logs.tar.gz ./*.log && rm -f ./*.log)
}

# step NAME CAP NEED COMMAND...: run COMMAND for at most CAP seconds and never past END;
# skipped when fewer than NEED seconds are left.
step() {
    local name=$1 cap=$2 need=$3
    shift 3
    local left=$((END - $(date +%s)))
    if ((left < need)); then
        echo "=== $name skipped at $(($(date +%s) - T0))s: ${left}s left" >> $L
        return
    fi
    ((left < cap)) && cap=$left
    echo "=== $name (at most ${cap}s) at $(($(date +%s) - T0))s" >> $L
    touch /tmp/texel-step-start
    timeout -k 15 "$cap" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc at $(($(date +%s) - T0))s" >> $L
    # Each server's model lines (which stream each model's work ran on) and warnings (a
    # fallback such as the model's own encoder), its first errors (a benchmark's 5xx
    # answers say only their status), and its log's tail when the step failed.
    local server_log
    for server_log in $(find /tmp -maxdepth 1 -name 'texel-test-*.log' \
        -newer /tmp/texel-step-start); do
        {
            echo "--- $server_log"
            grep -E "ready on|could not load|WARNING" "$server_log" | head -20
            grep -E -A12 "ERROR|Traceback" "$server_log" | head -80
            ((rc != 0)) && tail -60 "$server_log"
        } >> "$OUT/$name.log"
    done
}

# constant FILE NAME VALUE: FILE's line `NAME = ...` set to VALUE, for a variant measured
# in the device's copy of the tree (the file as committed kept aside on first use; other
# constants set before stay set); `committed` puts every such file back.
EDITED=()
constant() {
    local file=$1 name=$2 value=$3
    if [[ ! -f /tmp/committed/$file ]]; then
        mkdir -p "$(dirname "/tmp/committed/$file")" && cp "$file" "/tmp/committed/$file"
        EDITED+=("$file")
    fi
    sed -i "s/^$name = .*$/$name = $value/" "$file"
    grep -q "^$name = $value$" "$file" || { echo "no $name in $file" >> "$L"; exit 1; }
}
committed() {
    local file
    for file in "${EDITED[@]}"; do cp "/tmp/committed/$file" "$file"; done
}
