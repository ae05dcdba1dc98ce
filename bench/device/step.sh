# Sourced by the device calls: `step`, one bounded step of a call (expects T0, END, L, OUT).
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
    # Each server's model lines (which stream each model's work ran on), and its log's
    # tail when the step failed.
    local server_log
    for server_log in $(find /tmp -maxdepth 1 -name 'texel-test-*.log' \
        -newer /tmp/texel-step-start); do
        {
            echo "--- $server_log"
            grep -E "ready on|could not load" "$server_log"
            ((rc != 0)) && tail -60 "$server_log"
        } >> "$OUT/$name.log"
    done
}
