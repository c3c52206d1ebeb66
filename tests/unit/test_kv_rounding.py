"""The numpy engine's bf16 KV emulation (`kv_dtype="bfloat16"`), the reference the GPU
engine's bf16 pool is checked against: values stored as a bf16 cache would hold them."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llm_runner_svc.engines import create_engine  # noqa: E402
from llm_runner_svc.engines.base import DecodeRow, EnginePlan  # noqa: E402
from llm_runner_svc.engines.numpy_kernels import round_to_bf16  # noqa: E402
from llm_runner_svc.errors import InvalidArgument  # noqa: E402


def test_round_to_bf16_is_a_bf16_store_and_load():
    rng = np.random.default_rng(0)
    a = np.concatenate([rng.standard_normal(50_000) * 10, rng.standard_normal(50_000) * 1e-30,
                        [0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.0e38]])
    a = a.astype(np.float32)
    want = torch.from_numpy(a).to(torch.bfloat16).float().numpy()
    assert np.array_equal(round_to_bf16(a), want)


def _states(model, kv_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    eng = create_engine("numpy", model.config, model.weights, kv_dtype=kv_dtype)
    eng.preallocate(EnginePlan(max_batch=1, max_seq=64, page_size=16, num_pages=4,
                               hidden_layer=-1))
    prompt = [1, 300, 301, 302, 50]
    states = [eng.prefill(prompt, 0, [0, 1], capture_hidden=True).states]
    for i, tok in enumerate([60, 70, 80, 90]):
        (hs,) = eng.decode([DecodeRow(tok, len(prompt) + i, [0, 1], capture_hidden=True)])
        states.append(hs.states)
    pool = eng._kv_pool.copy()
    eng.close()
    return np.concatenate(states), pool


def test_bf16_kv_pool_holds_bf16_values_and_moves_states_slightly(stories):
    exact, exact_pool = _states(stories, "float32")
    rounded, pool = _states(stories, "bfloat16")
    assert np.array_equal(pool, round_to_bf16(pool))
    assert not np.array_equal(exact_pool, round_to_bf16(exact_pool))
    rel = np.linalg.norm(rounded - exact, axis=1) / np.linalg.norm(exact, axis=1)
    assert 0.0 < rel.max() < 3e-2


def test_unknown_kv_dtype_is_invalid(stories):
    with pytest.raises(InvalidArgument, match="kv_dtype"):
        create_engine("numpy", stories.config, stories.weights, kv_dtype="fp8")
