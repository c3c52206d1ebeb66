#!/usr/bin/env bash
# LoRA on one GPU in one call (< 4 minutes on an H200): install the carried wheels (.whl/),
# run the LoRA GPU tests (tests/unit/test_lora_gpu.py) and two decode-graph tests of the
# torch engine (its packed decode inputs now carry adapter slots), then benchmarks/bench_lora_gpu.py (7B
# shape, 8 adapters of rank 16 on all seven modules, batch 1, 8 and 32, after a line of
# per-kernel times per batch). Logs and JSON go to
# $OUT.  TESTS=0 skips the tests, BENCH=0 the benchmark; BENCH_ARGS: its arguments.
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. benchmarks/gpu_env.sh
gpu_setup || exit 1
rc=0
if [ "${TESTS:-1}" = 1 ]; then
    timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra -rP" \
        tests/unit/test_lora_gpu.py tests/unit/test_torch_gpu.py \
        -k "test_lora_gpu or stories_goldens or do_not_allocate" 2>&1 \
        | tee "$OUT/lora_gpu_tests.txt"
    rc=${PIPESTATUS[0]}
fi
if [ "${BENCH:-1}" = 1 ]; then
    timeout 180 python3 benchmarks/bench_lora_gpu.py --json "$OUT/bench_lora_gpu.json" \
        ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_lora_gpu.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
exit $rc
