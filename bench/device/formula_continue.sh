#!/usr/bin/env bash
# One call on an `nvidia-h200` machine (device tool): continue the shipped formula model
# as run 17 did (formula_train.sh: real images, the school collection, the LaTeX-drawn
# SETS, half of the real and drawn pictures also at 0.4-0.7 times their size), then
# score the result on the GPU: dev[:256] (train.py's own end) and the picture variants
# of 120 dev formulas through the server's adapter ($OUT/variants.log). The model comes
# back as $OUT/fm.tar.*; within about 9.5 minutes for MINUTES 6.5.
#   carry: .fd .whlt .rs/pack (bench/device/bundle.sh; SETS are files of .rs/pack)
#   command: [LR=2.5e-4] bash bench/device/formula_continue.sh MINUTES SEED SETS [EXTRA...]
#   (LR: the peak learning rate; EXTRA: train.py options)
#   e.g.:    bash bench/device/formula_continue.sh 6.5 21 .rs/pack/a.lvl.xz,.rs/pack/b.lvl.xz
MINUTES=${1:?usage: bash bench/device/formula_continue.sh MINUTES SEED SETS [EXTRA...]}
SEED=${2:?seed} SETS=${3:?sets}
shift 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whlt/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/d && tar xJf .fd/fd.tar.xz -C /tmp/d || exit 1
bash bench/device/formula_train.sh 0 "$MINUTES" "${LR:-2.5e-4}" 0.25 "$SEED" \
    --school /tmp/d/k12-formulas --rendered "$SETS" --rendered-fraction 0.35 \
    --small-share 0.5 "$@"
grep -E "^\||trained|rc=|smaller copies|rendered sets" $OUT/train.log
timeout 180 python3 -m training.formula.evaluate --data /tmp/d/im2latex-val --model /tmp/fm \
    --served --variants --limit 120 --dtype auto --batch-size 16 > $OUT/variants.log 2>&1
tail -23 $OUT/variants.log
