#!/usr/bin/env bash
# Install Arize Phoenix (an OTLP trace backend with a REST API) into its own venv,
# so its large dependency tree never touches Texel's. Idempotent: a finished
# install is marked by a stamp holding the spec, and is reused.
#
# Prints the venv's path on success. Exit status 3 means "cannot here" (no
# usable python3, not enough disk, or PyPI unreachable), which the tests turn
# into a skip outside CI and a failure under CI=true.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# One copy per user, shared by every checkout (a fresh clone reuses it); in the
# checkout itself where there is no home.
if [[ -n ${HOME:-} ]]; then DEFAULT_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/texel/backends
else DEFAULT_CACHE=$ROOT/.cache/backends; fi
CACHE=${TEXEL_BACKENDS_CACHE:-$DEFAULT_CACHE}
VENV=$CACHE/phoenix-venv
SPEC=${PHOENIX_SPEC:-arize-phoenix==20.26.1}
PYTHON=${PHOENIX_PYTHON:-python3}
NEED_MB=${PHOENIX_NEED_MB:-3000}
STAMP=$VENV/.texel-installed

if [[ -f $STAMP && "$(cat "$STAMP")" == "$SPEC" && -x $VENV/bin/phoenix ]]; then
    echo "$VENV"
    exit 0
fi

if ! command -v "$PYTHON" >/dev/null 2>&1 \
    || ! "$PYTHON" -c 'import sys, venv; assert (3, 10) <= sys.version_info < (3, 14)' 2>/dev/null; then
    echo "phoenix.sh: no python3 (3.10-3.13) with venv to install Phoenix into" >&2
    exit 3
fi
mkdir -p "$CACHE"
# One installer at a time; a second one waits, then finds the stamp.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE/phoenix.lock"
    flock 9
    if [[ -f $STAMP && "$(cat "$STAMP")" == "$SPEC" && -x $VENV/bin/phoenix ]]; then
        echo "$VENV"
        exit 0
    fi
fi
free_mb=$(df -Pm "$CACHE" | awk 'NR == 2 {print $4}')
if ((free_mb < NEED_MB)); then
    echo "phoenix.sh: ${free_mb} MB free in $CACHE, Phoenix needs about ${NEED_MB} MB" >&2
    exit 3
fi

echo "phoenix.sh: installing $SPEC into $VENV" >&2
start=$(date +%s)
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
if ! "$VENV/bin/python" -m pip install --quiet "$SPEC" >&2; then
    rm -rf "$VENV"
    echo "phoenix.sh: pip could not install $SPEC (is PyPI reachable?)" >&2
    exit 3
fi
echo "$SPEC" >"$STAMP"
echo "phoenix.sh: installed in $(($(date +%s) - start)) s, $(du -sm "$VENV" | cut -f1) MB" >&2
echo "$VENV"
