#!/usr/bin/env bash
# Images on one CUDA GPU, in one call: install the carried wheels (.whl/), then the vision
# tests of the torch engine (tests/unit/test_vision_gpu.py: float32 against transformers,
# bf16 within the GPU tolerances). The log goes to $OUT.
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. benchmarks/gpu_env.sh
gpu_setup "$PWD/tests" "$PWD/tests/unit" || exit 1
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -s -p no:cacheprovider -o addopts="-ra" \
    tests/unit/test_vision_gpu.py 2>&1 | tee "$OUT/vision_gpu_tests.txt"
exit "${PIPESTATUS[0]}"
