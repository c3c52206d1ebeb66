#!/usr/bin/env bash
# Prefix reuse on one GPU in one call (a few minutes on an H200): install the carried wheels
# (.whl/), run the GPU tests of the split prefill attention, then the attention of a short
# pass after a cached prompt (bench_attention.py --after: splits, tiles, merged by the last
# split or by a second launch) and the TTFT of a reusing request against a cold one
# (bench_prefix_cache.py, 7B shape, with the host/device timeline and the kernel profile),
# and whether weights read into L2 beside that attention speed up the products after it
# (bench_l2_prefetch.py). Logs go to $OUT.
#   TESTS=0 skips the tests, ATTN=0 the attention sweep, TTFT=0 the TTFT benchmark, L2=0 the
#   L2 reads;
#   TTFT_ARGS: more arguments for bench_prefix_cache.py.
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. benchmarks/gpu_env.sh
gpu_setup || exit 1
rc=0
if [ "${TESTS:-1}" = 1 ]; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra -rP" \
        tests/unit/test_torch_gpu.py -k "split_prefill_keys" 2>&1 | tee "$OUT/ctx_tests.txt"
    rc=${PIPESTATUS[0]}
fi
if [ "${TTFT:-1}" = 1 ]; then
    timeout 240 python3 benchmarks/bench_prefix_cache.py --engine torch --shape qwen2.5-7b \
        --rounds 5 --timeline --gpu-profile ${TTFT_ARGS:-} 2>&1 | tee "$OUT/bench_prefix_cache.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "${ATTN:-1}" = 1 ]; then
    timeout 240 python3 benchmarks/bench_attention.py --shapes qwen2.5-7b --prompts 50 \
        --after 2000 2>&1 | tee "$OUT/bench_attention_after.txt"
fi
if [ "${L2:-1}" = 1 ]; then
    timeout 120 python3 benchmarks/bench_l2_prefetch.py 2>&1 | tee "$OUT/bench_l2_prefetch.txt"
fi
exit $rc
