"""LoRA adapters on a CUDA GPU: decode rows on adapters replay the captured decode graphs
whose Triton kernels add each row's adapter from the stacked buffers (torch_lora.py).

- float32 on the GPU: a batch of 8 requests over 3 adapters and the base model gives every
  request the numpy engine's greedy tokens for its adapter, and an adapter put into a slot
  after the graphs were captured is what the next steps compute;
- bf16: the graphs' kernels (batch 1: the LoRA terms inside the fused products; a few rows:
  per-row kernels; more: kernels that group rows by adapter) against the grouped eager
  products on the same engine state, and against the float32 merged model within a small
  multiple of what rounding the merged model to bf16 moves the logits;
- decode steps with adapter rows replay graphs and allocate nothing.
These tests need a GPU; CI has none (the kernels run on Triton's CPU interpreter in
tests/unit/test_lora_slots.py and tests/unit/test_lora_fused.py).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from lora_fixtures import write_adapter  # noqa: E402

from llm_runner_svc.engines import create_engine  # noqa: E402
from llm_runner_svc.engines.base import EnginePlan  # noqa: E402
from llm_runner_svc.engines.batch import Batch, Row  # noqa: E402
from llm_runner_svc.models.lora import load_adapter, merge_adapter  # noqa: E402
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TARGETS = [None, ("q_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj")]
PROMPTS = [[1, 403, 407, 261, 378], [1, 70, 90, 33], [1, 365, 301, 271, 15, 8, 99, 44, 3],
           [1, 5], [1, 403, 407, 261, 378], [1, 70, 90, 33, 12, 19], [1, 9, 9, 9], [1, 88]]
ROUTES = [0, 1, 2, 3, 1, 2, 3, 0]


@pytest.fixture(scope="module")
def adapters(stories, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-adapters")
    return [load_adapter(f"a{i}", write_adapter(root / f"a{i}", stories.config, seed=10 + i,
                                                rslora=i == 2, **({"targets": t} if t else {})),
                         stories.config) for i, t in enumerate(TARGETS)]


def _runtime(stories, engine, max_batch: int) -> InferenceRuntime:
    rt = InferenceRuntime(engine, stories.tokenizer,
                          RuntimeConfig(max_batch=max_batch, max_seq=128, page_size=4))
    rt.preallocate()
    return rt


def _tokens(rt: InferenceRuntime, jobs, n: int = 16) -> list[list[int]]:
    sampling = resolve(rt.config.sampling, temperature=0.0, max_new_tokens=n)
    for i, (ids, k) in enumerate(jobs):
        rt.submit(GenerationRequest(f"r{i}", ids, sampling, ignore_eos=True, adapter=k))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(jobs))}
    while rt.has_work:
        for ev in rt.step():
            out[ev.request_id].extend(ev.token_ids)
    return [out[f"r{i}"] for i in range(len(jobs))]


def _numpy_tokens(stories, adapters, ids: list[int], k: int) -> list[int]:
    rt = _runtime(stories, create_engine("numpy", stories.config, stories.weights,
                                         adapters=adapters), 1)
    tokens = _tokens(rt, [(ids, k)])[0]
    rt.close()
    return tokens


def test_mixed_batch_in_graphs_matches_numpy(stories, adapters):
    jobs = list(zip(PROMPTS, ROUTES, strict=True))
    eng = create_engine("torch", stories.config, stories.weights, device="cuda",
                        dtype="float32", adapters=adapters)
    rt = _runtime(stories, eng, 8)
    assert eng.lora is not None and eng.lora.kernel == "triton"
    assert eng.graphs is not None and eng.graphs.has_lora
    got = _tokens(rt, jobs)
    rt.close()
    for (ids, k), tokens in zip(jobs, got, strict=True):
        assert tokens == _numpy_tokens(stories, adapters, ids, k), f"adapter {k}"


def test_adapter_set_after_capture(stories, adapters):
    eng = create_engine("torch", stories.config, stories.weights, device="cuda",
                        dtype="float32")
    eng.reserve_adapters(2)
    rt = _runtime(stories, eng, 2)  # the graphs are captured here
    jobs = [(PROMPTS[0], 2), (PROMPTS[1], 0)]
    before = _tokens(rt, jobs)
    assert before[0] == _numpy_tokens(stories, [], PROMPTS[0], 0)  # an empty slot: base
    eng.set_adapter(2, adapters[0])
    after = _tokens(rt, jobs)
    assert after[0] == _numpy_tokens(stories, [adapters[0]], PROMPTS[0], 1) != before[0]
    assert after[1] == before[1]
    eng.set_adapter(2, None)
    assert _tokens(rt, jobs) == before
    rt.close()


def _decode_logits(stories, adapters, jobs, weights=None, kernel="auto",
                   dtype="bfloat16") -> np.ndarray:
    """Logits of one decode step (after each job's prompt prefilled) of `jobs` (prompt,
    adapter) as one batch, on the GPU in `dtype` (adapters in stacked buffers of it)."""
    n = len(jobs)
    eng = create_engine("torch", stories.config, weights or stories.weights, device="cuda",
                        dtype=dtype, adapters=adapters)
    if adapters:
        eng.reserve_adapters(len(adapters), kernel=kernel)
    eng.preallocate(EnginePlan(max_batch=n, max_seq=64, page_size=4, num_pages=16 * n,
                               prefill_chunk=64))
    tables = [tuple(range(16 * r, 16 * r + 16)) for r in range(n)]
    prefill = [Row(tuple(ids), 0, tables[r], adapter=k) for r, (ids, k) in enumerate(jobs)]
    eng.read(eng.launch(Batch(tuple(prefill), keep_logits=True)))
    rows = [Row((7,), len(ids), tables[r], adapter=k) for r, (ids, k) in enumerate(jobs)]
    eng.read(eng.launch(Batch(tuple(rows), keep_logits=True)))
    out = np.array(eng.logits(n), dtype=np.float32)
    eng.close()
    return out


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float((np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)).max())


@pytest.mark.parametrize("n", [1, 3, 8, 20])
def test_bf16_graph_kernels_against_grouped_products(stories, adapters, n):
    """Batch 1: the fused products with each row's term inside; 3: cuBLAS products with
    per-row terms; 8 and 20 (two blocks of rows per adapter): the kernels that group rows
    by adapter."""
    jobs = [(PROMPTS[(i + 1) % 8], ROUTES[(i + 1) % 8]) for i in range(n)]
    got = _decode_logits(stories, adapters, jobs, kernel="triton")
    want = _decode_logits(stories, adapters, jobs, kernel="grouped")
    print(f"bf16 graph kernels vs grouped, batch {n}: worst rel {_rel(got, want):.1e}")
    assert _rel(got, want) < 2e-2


@pytest.mark.parametrize("n", [1, 6])
def test_bf16_against_the_merged_model(stories, adapters, n):
    """Every row on one adapter in bf16 against the truth, the merged model in float32:
    within 2.5 times what rounding the merged model to bf16 moves the logits (the adapter
    path rounds A, B and the shrink's result, a merged model its weights once; the test
    adapters' terms outweigh stories260K's own weights, so that rounding alone moves the
    logits by percents; test_lora.py checks the same on the CPU). At batch 1 the graph
    runs the fused products (the adapter's terms inside them: their shrinks norm the
    residual stream as the products do, the gate/up term goes in before the SiLU), at
    batch 6 cuBLAS with the grouped kernels (the adapter on all seven modules)."""
    jobs = [(PROMPTS[(2 + i) % 8], 0) for i in range(n)]
    for k, adapter in list(enumerate(adapters, 1))[:3 if n == 1 else 1]:
        got = _decode_logits(stories, adapters, [(ids, k) for ids, _ in jobs])
        merged = merge_adapter(stories.weights, adapter)
        truth = _decode_logits(stories, [], jobs, weights=merged, dtype="float32")
        rounded = _decode_logits(stories, [], jobs, weights=merged)
        print(f"bf16 batch {n}, adapter {k} against the float32 merged model: rel "
              f"{_rel(got, truth):.1e}; the bf16 merged model {_rel(rounded, truth):.1e}")
        assert _rel(got, truth) <= 2.5 * _rel(rounded, truth) + 1e-2


def test_adapter_decode_steps_replay_graphs_and_do_not_allocate(stories, adapters):
    eng = create_engine("torch", stories.config, stories.weights, device="cuda",
                        adapters=adapters)
    rt = InferenceRuntime(eng, stories.tokenizer, RuntimeConfig(max_batch=8, max_seq=256))
    rt.preallocate()
    assert eng.graphs is not None and eng.graphs.has_lora
    for i in range(8):
        rt.submit(GenerationRequest(f"r{i}", [1, 300 + i], resolve(
            rt.config.sampling, temperature=0.0, max_new_tokens=200), ignore_eos=True,
            adapter=i % 4))
    for _ in range(20):
        rt.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(150):
        assert len(rt.step()) == 8
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert torch.cuda.max_memory_allocated() == before
    rt.close()
