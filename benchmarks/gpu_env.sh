# Sourced by the benchmarks/gpu_*.sh runners, from the repository root.
# `gpu_setup [PATH ...]`: makes $OUT, installs the carried wheels (.whl/, made by
# benchmarks/gpu_wheels.sh on a machine with network) into $SITE (default /tmp/site) when
# there are any, puts $SITE, the PATHs, the repository and the Python client on PYTHONPATH,
# and writes the GPU's name, memory and clocks to $OUT/gpu.txt. Returns 1 only when the
# wheels do not install.
gpu_setup() {
    OUT=${OUT:-/tmp/gpu_out}
    SITE=${SITE:-/tmp/site}
    mkdir -p "$OUT"
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl || return 1
    fi
    local extra="" p
    for p in "$@"; do extra+=":$p"; done
    export PYTHONPATH="$SITE$extra:$PWD:$PWD/clients/python" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv \
        | tee "$OUT/gpu.txt" || true
}
