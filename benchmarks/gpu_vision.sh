#!/usr/bin/env bash
# Images on one CUDA GPU, in one call: install the carried wheels (.whl/), then the vision
# tests of the torch engine (tests/unit/test_vision_gpu.py: float32 against transformers,
# bf16 within the GPU tolerances). The log goes to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/clients/python:$PWD/tests:$PWD/tests/unit
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -s -p no:cacheprovider -o addopts="-ra" \
    tests/unit/test_vision_gpu.py 2>&1 | tee "$OUT/vision_gpu_tests.txt"
exit "${PIPESTATUS[0]}"
