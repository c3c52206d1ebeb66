#!/usr/bin/env bash
# The service path against the engine, A/B on one GPU in one call: benchmarks/bench_gpu.py
# (floor, graph, in-process, Step stream and orchestrator columns) run from each tree of TREES,
# one shape of SHAPES at a time (so a call cut short keeps the shapes done), the trees
# alternated ROUNDS times, then one table of every run (benchmarks/gpu_ab_table.py).
#   TREES: NAME=DIR pairs, DIR a copy of the repository at the commit to compare (e.g. made by
#   `git archive COMMIT | tar -x -C .ab/NAME`, .ab/ ignored and carried); default "new=.";
#   ROUNDS (default 2); BENCH_ARGS: bench_gpu.py's arguments for every tree (its own
#   defaults: batch 1, 8, 32 and 64); SHAPES (default the 0.5B, 7B and 1.5B shapes); ARGS_<NAME>: more
#   arguments for tree NAME alone (options older trees lack).
# Logs and JSON go to $OUT: ab.txt (every run's output) and ab_table.md.
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. benchmarks/gpu_env.sh
gpu_setup || exit 1
TREES=${TREES:-new=.}
ROUNDS=${ROUNDS:-2}
SHAPES=${SHAPES:-qwen2.5-0.5b qwen2.5-7b qwen2.5-1.5b}
RUNS=/tmp/ab_runs
mkdir -p "$RUNS"
for shape in $SHAPES; do
    for round in $(seq 1 "$ROUNDS"); do
        for pair in $TREES; do
            name=${pair%%=*}
            dir=$(cd "${pair#*=}" && pwd)
            echo "## $name ($dir), $shape, round $round" | tee -a "$OUT/ab.txt"
            own="ARGS_$name"
            # shellcheck disable=SC2086
            (cd "$dir" && PYTHONPATH="$SITE:$dir:$dir/clients/python" \
                timeout "${RUN_TIMEOUT:-900}" python3 benchmarks/bench_gpu.py \
                --shapes "$shape" --json "$RUNS/${name}_${round}_$shape.json" \
                ${BENCH_ARGS:-} ${!own:-}) >> "$OUT/ab.txt" 2>&1
            tail -n 20 "$OUT/ab.txt" | grep -E "^#|Error|error" | tail -n 3
        done
    done
    python3 benchmarks/gpu_ab_table.py "$RUNS"/*.json > "$OUT/ab_table.md"
done
cat "$OUT/ab_table.md"
