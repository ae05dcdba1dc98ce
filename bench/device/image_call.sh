# Sourced by the image benchmark calls (image_final.sh, image_compile.sh): installs the
# carried wheels, names the GPU in $OUT/bench.log and defines `step SECONDS MODULE ARGS...`,
# one benchmark run under a time limit, its output in the log.
#   expects: COMMIT set; carry .whl .whlx (bench/device/bundle.sh)
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl $(compgen -G '.whlb/*.whl') .whlx/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TEXEL_COMMIT=$COMMIT PYTHONUNBUFFERED=1
L=$OUT/bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
step() {
    local limit=$1; shift
    echo "=== $* at $(( $(date +%s) - T0 ))s" >> $L
    timeout "$limit" python3 -m "$@" >> $L 2>&1
    echo "=== rc=$? at $(( $(date +%s) - T0 ))s" >> $L
}
