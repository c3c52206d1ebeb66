"""The torch engine on the CPU (float32) against the numpy reference: same greedy tokens for
stories260K's goldens, SmolLM2 and tiny Hugging Face configs, same sampled tokens for seeded
requests, hidden states within 1e-5, and buffers claimed once."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import drain
from parity.conftest import build_hf_model

from llm_runner_svc.engines import create_engine
from llm_runner_svc.engines.base import DecodeRow, EnginePlan
from llm_runner_svc.engines.batch import Batch, Row
from llm_runner_svc.errors import FailedPrecondition, InvalidArgument
from llm_runner_svc.models import load_model
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve


def _runtime(model, engine: str, **cfg) -> InferenceRuntime:
    options = {"device": "cpu"} if engine == "torch" else {}
    rt = InferenceRuntime(create_engine(engine, model.config, model.weights, **options),
                          model.tokenizer, RuntimeConfig(**cfg))
    rt.preallocate()
    return rt


def _generate(rt: InferenceRuntime, ids: list[int], max_new: int, **sampling):
    req = GenerationRequest("g", ids, resolve(rt.config.sampling, max_new_tokens=max_new,
                                              **sampling), capture_hidden=rt.plan.hidden_layer
                            is not None)
    tokens, text, hidden = [], "", []
    for ev in rt.generate(req):
        tokens += ev.token_ids
        text += ev.text
        hidden += ev.hidden
    return tokens, text, hidden


def test_stories_goldens(stories, goldens):
    rt = _runtime(stories, "torch", max_batch=2, max_seq=512)
    try:
        bos = next(c for c in goldens["cases"] if c["name"] == "greedy_from_bos")
        tokens, text, _ = _generate(rt, bos["prompt_token_ids"], bos["steps"], temperature=0.0)
        assert tokens == bos["generated_token_ids"]
        assert text == bos["text"]
        dragon = next(c for c in goldens["cases"] if c["name"] == "greedy_dragon")
        ids = stories.tokenizer.encode(dragon["prompt"])
        _, text, _ = _generate(rt, ids, dragon["steps"] - len(ids) + 1, temperature=0.0)
        assert dragon["prompt"] + text == dragon["text"]
    finally:
        rt.close()


@pytest.mark.parametrize("layer, chunk", [(-1, 256), (1, 4), (5, 256)])
def test_hidden_states_match_numpy(stories, layer, chunk):
    prompt = stories.tokenizer.encode("Once upon a time, a dragon")
    got, want = [], []
    for engine, out in (("torch", got), ("numpy", want)):
        rt = _runtime(stories, engine, max_batch=2, max_seq=128, page_size=8,
                      prefill_chunk=chunk, hidden_layer=layer)
        tokens, _, hidden = _generate(rt, prompt, 12, temperature=0.0)
        rt.close()
        out.append(tokens)
        out.append(np.concatenate([h.states for h in hidden]))
        out.append(np.concatenate([h.embeddings for h in hidden]))
    assert got[0] == want[0]
    assert got[1].shape == want[1].shape == (len(prompt) + 11, 64)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 1e-5


def test_seeded_sampling_in_a_batch_matches_numpy(stories):
    outs = []
    for engine in ("torch", "numpy"):
        rt = _runtime(stories, engine, max_batch=4, max_seq=256)
        for i in range(6):  # more requests than rows: joins happen mid-run
            rt.submit(GenerationRequest(f"r{i}", [1, 300 + i], resolve(
                rt.config.sampling, temperature=0.9, top_k=(0, 40)[i % 2], top_p=0.9,
                max_new_tokens=30 + 5 * i, seed=i, logit_bias={1: -3.0} if i == 3 else None)))
        outs.append(drain(rt))
        rt.close()
    assert outs[0] == outs[1]
    assert len({tuple(v) for v in outs[0].values()}) == 6


def test_smollm2_greedy_matches_numpy():
    model = load_model("smollm2")
    prompt = model.chat_template.render([{"role": "user", "content": "What is a tide?"}])
    ids = model.tokenizer.encode(prompt, add_bos=False)
    runs = []
    for engine in ("torch", "numpy"):
        rt = _runtime(model, engine, max_batch=1, max_seq=256)
        runs.append(_generate(rt, ids, 24, temperature=0.0)[0])
        rt.close()
    assert len(runs[0]) == 24
    assert runs[0] == runs[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_hf_configs_match_numpy(arch, tmp_path):
    build_hf_model(arch, tmp_path / arch, seed=3)
    model = load_model(tmp_path / arch)
    prompt = [5, 17, 99, 42, 7, 250]
    runs = []
    for engine in ("torch", "numpy"):
        rt = _runtime(model, engine, max_batch=2, max_seq=128, hidden_layer=-1, page_size=4,
                      prefill_chunk=4)
        tokens, _, hidden = _generate(rt, prompt, 40, temperature=0.0, logit_bias={})
        rt.close()
        runs.append((tokens, np.concatenate([h.states for h in hidden])))
    (tokens, states), (ref_tokens, ref_states) = runs
    assert tokens == ref_tokens
    assert np.linalg.norm(states - ref_states) / np.linalg.norm(ref_states) < 1e-5


def _plan(**kw) -> EnginePlan:
    return EnginePlan(**{"max_batch": 4, "max_seq": 64, "page_size": 8, "num_pages": 32, **kw})


def test_lifecycle_and_bad_input_are_typed_errors(stories):
    eng = create_engine("torch", stories.config, stories.weights, device="cpu")
    with pytest.raises(FailedPrecondition):
        eng.decode([DecodeRow(1, 0, [0])])
    eng.preallocate(_plan())
    eng.preallocate(_plan())  # the same plan again: nothing happens
    with pytest.raises(FailedPrecondition):
        eng.preallocate(_plan(max_batch=8))
    with pytest.raises(InvalidArgument, match="vocabulary"):
        eng.prefill([1, stories.config.vocab_size], 0, [0])
    with pytest.raises(InvalidArgument, match="maxBatch"):
        eng.decode([DecodeRow(1, 0, [0])] * 5)
    with pytest.raises(InvalidArgument, match="maxSeq"):
        eng.decode([DecodeRow(1, 64, list(range(8)))])
    assert eng.memory_bytes() > 0
    eng.close()
    eng.close()
    assert eng.memory_bytes() == 0
    with pytest.raises(InvalidArgument, match="device"):
        create_engine("torch", stories.config, stories.weights, device="tpu")
    with pytest.raises(InvalidArgument, match="accept_hidden_layer"):
        create_engine("torch", stories.config, stories.weights, device="cpu").preallocate(
            _plan(hidden_layer=0))


def prefill_batch_against_solo(model, pass_tokens=64, **engine_options):
    """Three requests' chunks in one batch (one of them after 10 positions it prefilled
    before, on pages out of order; in passes of `pass_tokens`), and each request prefilled
    alone in one call on a second engine: returns per request ((batch logits, batch states),
    (solo logits, solo states))."""
    prompts = [[(7 * i + 3) % 300 + 1 for i in range(30)],
               [(11 * i + 5) % 300 + 1 for i in range(17)], [1, 9, 8, 7, 6]]
    tables = [[5, 2, 7, 0], [1, 3, 4], [6]]
    plan = _plan(max_seq=32, hidden_layer=-1, prefill_chunk=pass_tokens)
    engines = [create_engine("torch", model.config, model.weights, **engine_options)
               for _ in range(2)]
    for eng in engines:
        eng.preallocate(plan)
    batch, solo = engines
    first = batch.prefill(prompts[0][:10], 0, tables[0], capture_hidden=True)
    rows = [Row(tuple(prompts[0][10:]), 10, tables[0], capture_hidden=True),
            Row(tuple(prompts[1]), 0, tables[1], capture_hidden=True),
            Row(tuple(prompts[2]), 0, tables[2], capture_hidden=True)]
    states = batch.read(batch.launch(Batch(rows, keep_logits=True))).hidden
    logits = np.asarray(batch.logits(3))
    assert first is not None and all(s is not None for s in states)
    out = []
    for i, ids in enumerate(prompts):
        got = states[i].states
        if i == 0:
            got = np.concatenate([first.states, got])
        want = solo.prefill(ids, 0, tables[i], capture_hidden=True)
        out.append(((logits[i], got), (np.asarray(solo.logits(1)[0]), want.states)))
    for eng in engines:
        eng.close()
    return out


@pytest.mark.parametrize("pass_tokens", [64, 8])
def test_prefill_batch_matches_solo_prefills(stories, pass_tokens):
    """Chunks of several requests in one forward, or spread over passes (float32, CPU),
    give each request the logits and states of its own prefill."""
    for (logits, states), (want_logits, want_states) in prefill_batch_against_solo(
            stories, pass_tokens, device="cpu"):
        assert np.abs(logits - want_logits).max() < 1e-4
        assert np.linalg.norm(states - want_states) / np.linalg.norm(want_states) < 1e-5


def test_a_batch_that_does_not_fit_is_refused(stories):
    eng = create_engine("torch", stories.config, stories.weights, device="cpu")
    eng.preallocate(_plan(prefill_chunk=16))
    with pytest.raises(InvalidArgument, match="pages"):
        eng.launch(Batch([Row((1,) * 10, 0, [0])], keep_logits=True))
    with pytest.raises(InvalidArgument, match="maxBatch"):
        eng.launch(Batch([Row((1,), 0, [i]) for i in range(5)], keep_logits=True))
    with pytest.raises(InvalidArgument, match="maxSeq"):
        eng.launch(Batch([Row((1,) * 10, 60, list(range(9)))], keep_logits=True))
    eng.close()


def test_float32_prefill_products_are_the_default_for_small_models_only(stories):
    from llm_runner_svc.engines.torch_engine import default_fused_prefill_rows
    from llm_runner_svc.engines.torch_weights import named_shape

    assert default_fused_prefill_rows(stories.config) == 64
    assert default_fused_prefill_rows(named_shape("qwen2.5-0.5b")) == 64
    assert default_fused_prefill_rows(named_shape("qwen2.5-7b")) == 0
    eng = create_engine("torch", stories.config, stories.weights, device="cpu")
    assert eng.fused_prefill_rows == 64
