"""The onnxruntime graph engine against the numpy reference: logits over a prefill and 16
decode steps (two requests at different positions, so padding and masking are exercised),
hidden states, and greedy ids against the llama2.c goldens."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="the onnx extra")

from parity.conftest import build_hf_model  # noqa: E402

from llm_runner_svc.engines import create_engine  # noqa: E402
from llm_runner_svc.engines.base import DecodeRow, EnginePlan  # noqa: E402
from llm_runner_svc.models import load_model  # noqa: E402

TOLERANCE = {"onnx": 1e-4, "onnx-fp16": 5e-2}
DECODE_STEPS = 16


def _lockstep(model, name: str, hidden_layer: int | None = -1) -> list[float]:
    """Run numpy and `name` side by side, feeding both numpy's greedy tokens; return the
    largest logit and hidden-state gaps (prefill, then each decode step)."""
    plan = EnginePlan(max_batch=2, max_seq=64, page_size=8, num_pages=16, prefill_chunk=5,
                      hidden_layer=hidden_layer)
    ref = create_engine("numpy", model.config, model.weights)
    other = create_engine(name, model.config, model.weights)
    prompts = [[1, 5, 9, 30, 41, 7, 3], [1, 17, 4]]
    tables = [[3, 0, 5, 6, 8, 10, 12, 14], [1, 2, 4, 7, 9, 11, 13, 15]]  # scattered pages
    gaps: list[float] = []
    try:
        for eng in (ref, other):
            eng.preallocate(plan)
        tokens = []
        for prompt, table in zip(prompts, tables, strict=True):
            hs = [eng.prefill(prompt, 0, table, capture_hidden=True) for eng in (ref, other)]
            gaps.append(float(np.abs(ref.logits(1) - other.logits(1)).max()))
            gaps.append(float(np.abs(hs[0].states - hs[1].states).max()))
            assert hs[0].embeddings.shape == hs[1].embeddings.shape
            tokens.append(int(np.argmax(ref.logits(1)[0])))
        pos = [len(p) for p in prompts]
        for _ in range(DECODE_STEPS):
            rows = [DecodeRow(tokens[i], pos[i], tables[i], capture_hidden=True) for i in (0, 1)]
            hs = [eng.decode(rows) for eng in (ref, other)]
            gaps.append(float(np.abs(ref.logits(2) - other.logits(2)).max()))
            gaps.append(max(float(np.abs(a.states - b.states).max())
                            for a, b in zip(hs[0], hs[1], strict=True)))
            tokens = [int(t) for t in np.argmax(ref.logits(2), axis=1)]
            pos = [p + 1 for p in pos]
    finally:
        ref.close()
        other.close()
    return gaps


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


@pytest.mark.parametrize("engine", ["onnx", "onnx-fp16"])
def test_stories260k_logits_and_hidden_match_numpy(stories, engine):
    gaps = _lockstep(stories, engine)
    assert len(gaps) == 4 + 2 * DECODE_STEPS
    assert max(gaps) < TOLERANCE[engine], gaps


@pytest.mark.parametrize("engine", ["onnx", "onnx-fp16"])
def test_smollm2_logits_and_hidden_match_numpy(smollm2, engine):
    assert max(_lockstep(smollm2, engine)) < TOLERANCE[engine]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("engine", ["onnx", "onnx-fp16"])
def test_tiny_hf_models_match_numpy(tmp_path, arch, engine):
    build_hf_model(arch, tmp_path / arch)
    model = load_model(tmp_path / arch)
    assert max(_lockstep(model, engine, hidden_layer=1)) < TOLERANCE[engine]


@pytest.mark.parametrize("engine", ["onnx", "onnx-fp16"])
def test_greedy_ids_equal_the_goldens(stories, goldens, engine):
    case = next(c for c in goldens["cases"] if c["name"] == "greedy_from_bos")
    plan = EnginePlan(max_batch=1, max_seq=512, page_size=16, num_pages=32)
    eng = create_engine(engine, stories.config, stories.weights)
    eng.preallocate(plan)
    try:
        ids = list(case["prompt_token_ids"])
        table = list(range(32))
        eng.prefill(ids, 0, table)
        out = []
        for _ in range(case["steps"]):
            out.append(int(np.argmax(eng.logits(1)[0])))
            eng.decode([DecodeRow(out[-1], len(ids) + len(out) - 1, table)])
    finally:
        eng.close()
    assert out == case["generated_token_ids"]
