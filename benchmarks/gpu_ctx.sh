#!/usr/bin/env bash
# Prefix reuse on one GPU in one call (several minutes on an H200): install the carried
# wheels (.whl/), run the GPU tests of the split prefill attention and the short products,
# sweep the short products' tilings against cuBLAS at the 7B layer shapes
# (bench_short_products.py, those that beat it written to $OUT/short_tilings.json), then the
# TTFT of a reusing request against a cold one (bench_prefix_cache.py, 7B shape, with the
# host/device timeline): as the engine runs it (with the swept tilings when SHORT=1; with the
# kernel profile), then with every product on the default cuBLAS (--short-prefill-rows 0),
# in the same call (and on the engine's own tilings when the sweep ran); then the attention
# of a short pass after a cached prompt (bench_attention.py --after: splits, tiles, merged
# by the last split or by a second launch). Logs go to $OUT; the SM clock and power are
# sampled every 20 ms through the TTFT runs ($OUT/clocks.csv).
#   TESTS=0 skips the tests, SHORT=0 the tilings sweep (the TTFT runs on the engine's
#   measured default then), TTFT=0 the TTFT runs, CUBLAS=0 the one on cuBLAS, ATTN=0 the
#   attention sweep; L2=1 adds the L2 reads beside the attention (bench_l2_prefetch.py);
#   TEST_K: which GPU tests (pytest -k); SHORT_PRODUCTS: which products the sweep times
#   (default all four); TTFT_ARGS: more arguments for bench_prefix_cache.py; PAUSE=MS adds
#   a TTFT run whose reusing requests come MS after the cold ones, the device idle between;
#   ALT="ARGS" adds one with those arguments (another engine setting against the default).
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. benchmarks/gpu_env.sh
gpu_setup || exit 1
rc=0
if [ "${TESTS:-1}" = 1 ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra -rP" \
        tests/unit/test_torch_gpu.py -k "${TEST_K:-split_prefill_keys or short_products}" 2>&1 \
        | tee "$OUT/ctx_tests.txt"
    rc=${PIPESTATUS[0]}
fi
tilings=()
if [ "${SHORT:-1}" = 1 ]; then
    timeout 240 python3 benchmarks/bench_short_products.py --write "$OUT/short_tilings.json" \
        --products "${SHORT_PRODUCTS:-q/k/v,o,gate/up,down}" 2>&1 \
        | tee "$OUT/bench_short_products.txt"
    [ -s "$OUT/short_tilings.json" ] && tilings=(--short-prefill-rows 64 --short-tilings \
        "$OUT/short_tilings.json")
fi
ttft() {  # ttft NAME ARGS...: a TTFT run, its log in $OUT/bench_prefix_cache[_NAME].txt
    local log="$OUT/bench_prefix_cache${1:+_$1}.txt"
    shift
    # shellcheck disable=SC2086
    timeout 200 python3 benchmarks/bench_prefix_cache.py --engine torch --shape qwen2.5-7b \
        --rounds 5 --timeline "$@" ${TTFT_ARGS:-} 2>&1 | tee "$log"
    return "${PIPESTATUS[0]}"
}
if [ "${TTFT:-1}" = 1 ]; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu \
        --format=csv -lms 20 >"$OUT/clocks.csv" 2>/dev/null &
    clocks=$!
    ttft "" --gpu-profile "${tilings[@]}" || rc=1
    [ "${CUBLAS:-1}" = 1 ] && ttft cublas --short-prefill-rows 0
    # after a sweep: the engine's own tilings, against the swept ones above
    [ ${#tilings[@]} -gt 0 ] && ttft default
    # shellcheck disable=SC2086
    [ -n "${ALT:-}" ] && ttft alt "${tilings[@]}" $ALT
    [ -n "${PAUSE:-}" ] && ttft pause --pause-ms "$PAUSE" "${tilings[@]}"
    kill "$clocks" 2>/dev/null
fi
if [ "${ATTN:-1}" = 1 ]; then
    timeout 180 python3 benchmarks/bench_attention.py --shapes qwen2.5-7b --prompts 50 \
        --after 2000 2>&1 | tee "$OUT/bench_attention_after.txt"
fi
if [ "${L2:-0}" = 1 ]; then
    timeout 120 python3 benchmarks/bench_l2_prefetch.py 2>&1 | tee "$OUT/bench_l2_prefetch.txt"
fi
exit $rc
