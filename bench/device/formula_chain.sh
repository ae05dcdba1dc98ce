#!/usr/bin/env bash
# One call on a one-GPU machine (device tool): continue the shipped formula model several
# times in a row, each continuation from the end of the one before, and keep every end: a
# lineage of checkpoints for `python -m training.formula.average`. The mix is run 28's
# (batches mostly im2latex-like: real 0.3, LaTeX-drawn 0.45, the rest drawn on the fly,
# half of it school maths; half of the real and drawn pictures also at 0.4-0.7 times
# their size). Continuation N comes back as $OUT/cN.tar.* (a folder fm/), cN.log, cN.jsonl;
# each takes about MINUTES plus 1.5 minutes of loading and scoring. A call brings back at
# most 64 MiB, two models: two continuations, or one with CYCLES (its end and fm-mean).
#   carry: .fd .whlt .rs/pack (bench/device/bundle.sh; the sets are files of .rs/pack)
#   command: [LR=1e-4] [REAL=0.3] [CYCLES=N] bash bench/device/formula_chain.sh MINUTES SEED
#            SETS [SETS...]
#   (SETS: one continuation's comma-separated LaTeX-drawn sets; REAL: the real pictures'
#   share of each batch; CYCLES: each continuation trains with train.py --cycles N, and
#   the mean of its cycle ends comes back beside it)
#   e.g.:    bash bench/device/formula_chain.sh 3 131 .rs/pack/a.lvl.xz,.rs/pack/b.lvl.xz \
#                .rs/pack/b.lvl.xz,.rs/pack/c.lvl.xz
MINUTES=${1:?usage: bash bench/device/formula_chain.sh MINUTES SEED SETS [SETS...]}
SEED=${2:?seed}
shift 2
[ $# -gt 0 ] || { echo "no SETS given" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whlt/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/d && tar xJf .fd/fd.tar.xz -C /tmp/d || exit 1
init=models/formula/default n=0
for sets in "$@"; do
    n=$((n + 1))
    rm -rf /tmp/fm
    INIT=$init TAG=c$n bash bench/device/formula_train.sh 0 "$MINUTES" "${LR:-1e-4}" "${REAL:-0.3}" \
        $((SEED + n - 1)) --school /tmp/d/k12-formulas --rendered "$sets" \
        --rendered-fraction 0.45 --small-share 0.5 --merges 50 ${CYCLES:+--cycles "$CYCLES"}
    grep -E "^\| (BLEU|norm|exact)|trained|rc=" "$OUT/c$n.log"
    [ -f /tmp/fm/model.safetensors ] || exit 1
    rm -rf "/tmp/c$n" && cp -r /tmp/fm "/tmp/c$n" && init=/tmp/c$n
done
