#!/usr/bin/env bash
# Fetch Debian's `prometheus` package and unpack it under .cache/backends, without
# installing it: `apt-get download` + `dpkg-deb -x` starts no system service and
# touches nothing outside the cache. Idempotent.
#
# Prints the directory holding the `prometheus` and `promtool` binaries. Exit
# status 3 means "cannot here" (no apt-get/dpkg-deb, or the package cannot be
# downloaded), which the tests turn into a skip outside CI.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# One copy per user, shared by every checkout (a fresh clone reuses it); in the
# checkout itself where there is no home.
if [[ -n ${HOME:-} ]]; then DEFAULT_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/texel/backends
else DEFAULT_CACHE=$ROOT/.cache/backends; fi
CACHE=${TEXEL_BACKENDS_CACHE:-$DEFAULT_CACHE}
DEST=$CACHE/prometheus
BIN=$DEST/usr/bin

if [[ -x $BIN/prometheus && -x $BIN/promtool ]]; then
    echo "$BIN"
    exit 0
fi

for tool in apt-get dpkg-deb; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "prometheus.sh: $tool not found; Debian's prometheus package cannot be fetched here" >&2
        exit 3
    fi
done

mkdir -p "$CACHE"
# One fetcher at a time; a second one waits, then finds the binaries.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE/prometheus.lock"
    flock 9
    if [[ -x $BIN/prometheus && -x $BIN/promtool ]]; then
        echo "$BIN"
        exit 0
    fi
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"  # so apt's unprivileged _apt user can write the download
download() { (cd "$work" && apt-get download prometheus >&2); }
# A fresh machine has no package lists yet: refresh them once and retry.
if ! download; then
    echo "prometheus.sh: apt-get download failed, running apt-get update" >&2
    if ! apt-get update >&2 || ! download; then
        echo "prometheus.sh: could not download Debian's prometheus package" >&2
        exit 3
    fi
fi

rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp"
dpkg-deb -x "$work"/prometheus_*.deb "$DEST.tmp"
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
echo "prometheus.sh: unpacked $(basename "$work"/prometheus_*.deb) into $DEST" >&2
echo "$BIN"
