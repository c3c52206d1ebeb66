#!/usr/bin/env bash
# Speculative decoding on one CUDA GPU, in one call: install the carried wheels (.whl/),
# run the GPU exactness tests (tests/unit/test_spec_gpu.py, and the verify step as decode
# rows against the prefill path: tests/unit/test_verify_decode_rows.py), then
# benchmarks/bench_spec_gpu.py (verify, draft and layer-skip costs at the 7B shape, batches
# 1, 8 and 32). Logs and JSON go to $OUT. SPEC_ARGS: the benchmark's arguments; TESTS=0 skips the tests.
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. benchmarks/gpu_env.sh
gpu_setup || exit 1
status=0
if [ "${TESTS:-1}" = 1 ]; then
    timeout "${TEST_TIMEOUT:-90}" python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" \
        tests/unit/test_spec_gpu.py tests/unit/test_verify_decode_rows.py -k "gpu" 2>&1 | tee "$OUT/spec_gpu_tests.txt"
    status=${PIPESTATUS[0]}
fi
timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_spec_gpu.py \
    --json "$OUT/bench_spec_gpu.json" ${SPEC_ARGS:-} 2>&1 | tee "$OUT/bench_spec_gpu.txt"
bench=${PIPESTATUS[0]}
[ "$status" = 0 ] && [ "$bench" = 0 ]
