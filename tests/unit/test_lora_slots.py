"""LoRA adapter slots of the engines: the torch engine's stacked buffers and their per-row
products (the Triton kernels, run by Triton's interpreter on the CPU, and the gathered torch
products) against the grouped products, and adapters put into and taken out of slots at
run time giving exactly the merged model's tokens."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from lora_fixtures import write_adapter  # noqa: E402
from triton_interpreter import rerun_interpreted  # noqa: E402

from llm_runner_svc.engines import create_engine  # noqa: E402
from llm_runner_svc.engines.torch_lora import TorchLora  # noqa: E402
from llm_runner_svc.errors import InvalidArgument  # noqa: E402
from llm_runner_svc.models.lora import load_adapter, merge_adapter  # noqa: E402
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve  # noqa: E402


@pytest.fixture(scope="module")
def two_adapters(stories, tmp_path_factory):
    root = tmp_path_factory.mktemp("slots")
    return [load_adapter("x", write_adapter(root / "x", stories.config, seed=3, rank=4),
                         stories.config),
            load_adapter("y", write_adapter(root / "y", stories.config, seed=4, rank=2,
                                            targets=("k_proj", "up_proj", "down_proj")),
                         stories.config)]


# rows of a few-row decode step (each gathers its adapter), of a batch the kernels group by
# adapter, and of ones whose adapters interleave over several blocks of 16 rows each
ROW_SLOTS = {"few": [3, 0, 1], "batch": [0, 1, 3, 1, 0, 3, 3],
             "blocks": [(i * 7) % 5 % 4 for i in range(37)],
             "many blocks": [(i * 5) % 7 % 4 for i in range(150)]}


@pytest.mark.parametrize("rows", list(ROW_SLOTS))
@pytest.mark.parametrize("kernel", ["gather", "triton"])
def test_per_row_products_match_the_grouped_ones(stories, two_adapters, kernel, rows,
                                                 request):
    if kernel == "triton" and rerun_interpreted(request):
        return
    cfg = stories.config
    cpu = torch.device("cpu")
    lora = TorchLora(cfg, [], cpu, num_slots=3, max_rank=8, kernel=kernel)
    grouped = TorchLora(cfg, [], cpu, num_slots=3, max_rank=8, kernel="grouped")
    for lo in (lora, grouped):
        lo.set(1, two_adapters[0])
        lo.set(3, two_adapters[1])
    slots = ROW_SLOTS[rows]
    lora.reserve(len(slots))
    on_base = [i for i, k in enumerate(slots) if k == 0]
    on_adapter = slots.index(1)
    idx = torch.tensor(slots, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    lora.begin_rows(idx)
    for layer in range(cfg.num_layers):
        for matrix in ("qkv", "o", "gate_up", "down"):
            n_in = lora.a[matrix].shape[2]
            n_out = lora.b[matrix].shape[3]
            x = torch.randn(len(slots), n_in, generator=gen)
            base = torch.randn(len(slots), n_out, generator=gen)
            got, want = base.clone(), base.clone()
            lora.add_rows(layer, matrix, x, got, idx)
            grouped.add(layer, matrix, x, want, grouped.groups(slots, [1] * len(slots)))
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
            assert torch.equal(got[on_base], base[on_base])  # base rows: untouched
            assert not torch.equal(got[on_adapter], base[on_adapter])


def test_rank_above_the_slots_rank_is_refused(stories, two_adapters):
    lora = TorchLora(stories.config, [], torch.device("cpu"), num_slots=1, max_rank=2)
    with pytest.raises(InvalidArgument, match="rank 4.*up to 2"):
        lora.set(1, two_adapters[0])


def _tokens(stories, engine, prompt: list[int], adapter: int, n: int = 12) -> list[int]:
    rt = InferenceRuntime(engine, stories.tokenizer,
                          RuntimeConfig(max_batch=2, max_seq=64, page_size=4))
    rt.preallocate()
    req = GenerationRequest("r", prompt, resolve(rt.config.sampling, temperature=0.0,
                                                 max_new_tokens=n), ignore_eos=True,
                            adapter=adapter)
    tokens = [t for ev in rt.generate(req) for t in ev.token_ids]
    rt.engine.close()
    return tokens


@pytest.mark.parametrize("engine", ["numpy", "torch"])
def test_adapters_set_and_cleared_at_run_time(stories, two_adapters, engine):
    prompt = [1, 403, 407, 261, 378]
    eng = create_engine(engine, stories.config, stories.weights)
    eng.reserve_adapters(2)
    assert eng.num_adapters == 2
    base = _tokens(stories, create_engine(engine, stories.config, stories.weights), prompt, 0)
    for adapter in two_adapters:
        merged = create_engine(engine, stories.config, merge_adapter(stories.weights, adapter))
        want = _tokens(stories, merged, prompt, 0)
        assert want != base
        eng.set_adapter(2, adapter)
        assert _tokens(stories, eng, prompt, 2) == want
        assert _tokens(stories, eng, prompt, 0) == base
    eng.set_adapter(2, None)
    assert _tokens(stories, eng, prompt, 2) == base  # an empty slot adds nothing
    with pytest.raises(InvalidArgument, match="slot 3"):
        eng.set_adapter(3, two_adapters[0])


def test_a_reused_slot_never_matches_the_old_adapters_prefix_pages(stories, two_adapters):
    """Pages the prefix cache keeps for a slot's adapter are keyed by what the slot holds:
    once the runtime puts another adapter there, the same prompt prefills afresh and gets
    the new adapter's tokens."""
    eng = create_engine("numpy", stories.config, stories.weights)
    eng.reserve_adapters(1)
    rt = InferenceRuntime(eng, stories.tokenizer, RuntimeConfig(
        max_batch=2, max_seq=64, page_size=4, prefix_cache=True))
    rt.preallocate()
    prompt = [1, 403, 407, 261, 378, 70, 90, 33, 12, 19, 5, 44, 3]

    def run() -> tuple[list[int], int]:
        req = GenerationRequest("r", prompt, resolve(rt.config.sampling, temperature=0.0,
                                                     max_new_tokens=8), ignore_eos=True,
                                adapter=1)
        events = list(rt.generate(req))
        assert events[-1].metrics is not None
        return [t for ev in events for t in ev.token_ids], events[-1].metrics.cached_tokens

    want = {}
    for adapter in two_adapters:
        merged = create_engine("numpy", stories.config, merge_adapter(stories.weights,
                                                                     adapter))
        want[adapter.name] = _tokens(stories, merged, prompt, 0, n=8)
    rt.set_adapter(1, two_adapters[0])
    first, cached = run()
    assert first == want["x"] and cached == 0
    assert run() == (want["x"], 12)  # the same adapter: its pages are matched
    rt.set_adapter(1, two_adapters[1])
    assert run() == (want["y"], 0)
    rt.close()
