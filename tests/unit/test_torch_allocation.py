"""The torch engine's decode steps on the CPU: buffers are claimed once in preallocate(), and
a step leaves nothing allocated behind (torch's allocator is back where it started after
every step, so 200 steps hold exactly what 10 did)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from llm_runner_svc.engines import create_engine  # noqa: E402
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve  # noqa: E402


def _buffers(engine) -> dict[str, tuple[int, int]]:
    state = engine.state
    return {name: (t.data_ptr(), t.nbytes) for name, t in vars(state).items()}


def test_decode_steps_allocate_nothing_that_outlives_them(stories):
    eng = create_engine("torch", stories.config, stories.weights, device="cpu")
    rt = InferenceRuntime(eng, stories.tokenizer, RuntimeConfig(max_batch=8, max_seq=512,
                                                                hidden_layer=-1))
    rt.preallocate()
    held, buffers = eng.memory_bytes(), _buffers(eng)
    for i in range(8):
        rt.submit(GenerationRequest(f"r{i}", [1, 300 + i], resolve(
            rt.config.sampling, temperature=(0.0, 0.8)[i % 2], max_new_tokens=400, seed=i),
            ignore_eos=True, capture_hidden=i == 5))
    for _ in range(10):
        rt.step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(200):
            assert len(rt.step()) == 8
    events = prof.events()
    net_bytes = sum(e.self_cpu_memory_usage for e in events)
    allocated = sum(e.self_cpu_memory_usage for e in events if e.self_cpu_memory_usage > 0)
    assert allocated > 0  # the profiler saw the step's temporaries come and go
    assert net_bytes == 0
    assert _buffers(eng) == buffers and eng.memory_bytes() == held
    assert held >= eng.state.k_pool.nbytes * 2 + eng.state.logits.nbytes
    rt.close()
    assert eng.memory_bytes() == 0
    assert torch.get_num_threads() == 1
