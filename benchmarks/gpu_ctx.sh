#!/usr/bin/env bash
# Prefix reuse on one GPU in one call (a few minutes on an H200): install the carried wheels
# (.whl/), run the GPU tests of the split prefill attention, then the attention of a short
# pass after a cached prompt (bench_attention.py --after: splits, tiles, merged by the last
# split or by a second launch) and the TTFT of a reusing request against a cold one
# (bench_prefix_cache.py, 7B shape, with the host/device timeline); the short-window
# products against cuBLAS (bench_skinny.py). Logs go to $OUT.
#   TESTS=0 skips the tests, ATTN=0 the attention sweep, TTFT=0 the TTFT benchmark,
#   SKINNY=0 the products (SKINNY_ARGS: its arguments);
#   TTFT_ARGS: more arguments for bench_prefix_cache.py.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/clients/python PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
rc=0
if [ "${TESTS:-1}" = 1 ]; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra -rP" \
        tests/unit/test_torch_gpu.py -k "split_prefill_keys or skinny" 2>&1 | tee "$OUT/ctx_tests.txt"
    rc=${PIPESTATUS[0]}
fi
if [ "${TTFT:-1}" = 1 ]; then
    for sk in 1 0; do
        timeout 200 python3 benchmarks/bench_prefix_cache.py --engine torch \
            --shape qwen2.5-7b --rounds 5 --timeline --skinny-products $sk \
            $([ $sk = 1 ] && echo --gpu-profile) ${TTFT_ARGS:-} \
            2>&1 | tee "$OUT/bench_prefix_cache_skinny$sk.txt"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    done
fi
if [ "${ATTN:-1}" = 1 ]; then
    timeout 120 python3 benchmarks/bench_attention.py --shapes qwen2.5-7b --prompts 50 \
        --after 2000 2>&1 | tee "$OUT/bench_attention_after.txt"
fi
if [ "${SKINNY:-1}" = 1 ]; then
    timeout 300 python3 benchmarks/bench_skinny.py --shape qwen2.5-7b --rows 50 \
        ${SKINNY_ARGS:-} 2>&1 | tee "$OUT/bench_skinny.txt"
fi
exit $rc
