#!/usr/bin/env bash
# Fetch Debian's `chromium` and `chromium-common` packages, and the libraries they need
# that this system lacks, and unpack them under the backends cache without installing
# them: `apt-get download` + `dpkg-deb -x` touches nothing outside the cache. Which
# libraries are missing is apt's own answer (`apt-get install -s`, a simulation), so a
# system that already has them fetches only the browser. Idempotent.
#
# Prints the path of a launcher that runs the unpacked browser with its libraries (for
# Playwright's `executable_path`). Exit status 3 means "cannot here" (no apt-get or
# dpkg-deb, the packages cannot be downloaded, or a library is still missing), which
# the tests turn into a skip outside CI.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# One copy per user, shared by every checkout (a fresh clone reuses it); in the
# checkout itself where there is no home.
if [[ -n ${HOME:-} ]]; then DEFAULT_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/texel/backends
else DEFAULT_CACHE=$ROOT/.cache/backends; fi
CACHE=${TEXEL_BACKENDS_CACHE:-$DEFAULT_CACHE}
DEST=$CACHE/chromium
LAUNCHER=$DEST/chromium  # written last: its presence marks a finished unpack

if [[ -x $LAUNCHER ]]; then
    echo "$LAUNCHER"
    exit 0
fi

for tool in apt-get dpkg-deb ldd; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "chromium.sh: $tool not found; Debian's chromium package cannot be fetched here" >&2
        exit 3
    fi
done

mkdir -p "$CACHE"
# One fetcher at a time; a second one waits, then finds the launcher.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE/chromium.lock"
    flock 9
    if [[ -x $LAUNCHER ]]; then
        echo "$LAUNCHER"
        exit 0
    fi
fi

work=$(mktemp -d)
trap 'rm -rf "$work" "$DEST.tmp"' EXIT
chmod 755 "$work"  # so apt's unprivileged _apt user can write the download
# What installing chromium would add to this system, besides chromium itself.
missing() {
    apt-get install -s --no-install-recommends chromium 2>/dev/null \
        | awk '/^Inst / && $2 != "chromium" && $2 != "chromium-common" {print $2}'
}
download() {
    local libraries
    libraries=$(missing) || return 1
    # shellcheck disable=SC2086 # one package name a word
    (cd "$work" && apt-get download chromium chromium-common $libraries >&2)
}
# A fresh machine has no package lists yet: refresh them once and retry.
if ! download; then
    echo "chromium.sh: apt-get download failed, running apt-get update" >&2
    if ! apt-get update >&2 || ! download; then
        echo "chromium.sh: could not download Debian's chromium packages" >&2
        exit 3
    fi
fi

rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp"
for deb in "$work"/*.deb; do
    dpkg-deb -x "$deb" "$DEST.tmp"
done
# Every unpacked folder of shared libraries, relative to the launcher; the browser's
# own folder is found through its RUNPATH.
library_dirs=$(cd "$DEST.tmp" && find usr/lib -name 'lib*.so*' -not -path 'usr/lib/chromium/*' \
    -printf '%h\n' | sort -u)
library_path=""
for dir in $library_dirs; do library_path+="${library_path:+:}\$here/$dir"; done
not_found=$(LD_LIBRARY_PATH=${library_path//\$here/$DEST.tmp} ldd "$DEST.tmp/usr/lib/chromium/chromium" \
    | awk '/not found/ {print $1}')
if [[ -n $not_found ]]; then
    echo "chromium.sh: the unpacked chromium still lacks:" $not_found >&2
    exit 3
fi
cat >"$DEST.tmp/chromium" <<EOF
#!/bin/sh
# Debian's Chromium, unpacked by tests/backends/chromium.sh, with the libraries beside it.
here=\$(dirname "\$(readlink -f "\$0")")
LD_LIBRARY_PATH=${library_path}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
export LD_LIBRARY_PATH
exec "\$here/usr/lib/chromium/chromium" "\$@"
EOF
chmod 755 "$DEST.tmp/chromium"
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
echo "chromium.sh: unpacked $(cd "$work" && echo *.deb | wc -w) packages" \
    "($(basename "$work"/chromium_*.deb)) into $DEST" >&2
echo "$LAUNCHER"
