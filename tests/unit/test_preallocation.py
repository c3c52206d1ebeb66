"""preallocate() claims the buffers once; decoding does not grow memory per token."""

from __future__ import annotations

import tracemalloc

from helpers import make_runtime

from llm_runner_svc.runtime import GenerationRequest, SamplingParams


def test_buffers_are_claimed_once_and_sized_by_batch_and_seq(stories):
    rt = make_runtime(stories, max_batch=4, max_seq=128, page_size=16)
    eng = rt.engine
    c = stories.config
    assert rt.plan.num_pages == 4 * 128 // 16
    pool = eng._kv_pool
    assert pool.shape == (c.num_layers, rt.plan.num_pages * 16, 2 * c.kv_dim)
    held = eng.memory_bytes()
    assert held >= pool.nbytes
    for i in range(4):
        rt.submit(GenerationRequest(f"r{i}", [1, 403 + i], SamplingParams(0.7, 20, 0.9, 60, i)))
    while rt.has_work:
        rt.step()
    assert eng._kv_pool is pool and eng.memory_bytes() == held
    rt.preallocate()  # idempotent
    assert eng._kv_pool is pool
    rt.close()
    rt.close()  # idempotent
    assert eng.memory_bytes() == 0


def test_decode_steps_do_not_grow_memory(stories):
    rt = make_runtime(stories, max_batch=8, max_seq=512)
    for i in range(8):
        rt.submit(GenerationRequest(f"r{i}", [1, 300 + i], SamplingParams(0.8, 40, 0.9, 400, i),
                                    ignore_eos=True))
    for _ in range(20):
        rt.step()
    tracemalloc.start()
    for _ in range(10):
        rt.step()
    after_10, _ = tracemalloc.get_traced_memory()
    for _ in range(200):
        rt.step()
    after_210, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # what may grow: each request's output ids and text (a few bytes per token); a per-step
    # array left behind would be kilobytes per step
    assert after_210 - after_10 < 200 * 8 * 80
    rt.close()
