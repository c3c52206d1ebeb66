"""Speculative greedy decoding is plain greedy decoding, token for token, on real and tiny
Hugging Face models: SmolLM2 (GGUF) repeating a passage, and random llama, qwen2 and qwen3
checkpoints, with every proposer (ngram, self, draft) on the numpy and torch (CPU) engines,
each speculative request in a batch beside a plain one."""

from __future__ import annotations

import pytest
from parity.conftest import build_hf_model

from llm_runner_svc.engines import create_engine
from llm_runner_svc.engines.drafts import create_draft_engine
from llm_runner_svc.models import load_model
from llm_runner_svc.runtime import (
    GenerationRequest,
    InferenceRuntime,
    RuntimeConfig,
    SpecConfig,
    resolve,
)

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed "
           "the wick, polished the great lens, and wrote the weather in a leather logbook.")


def _greedy(model, engine: str, prompts, max_new: int, spec: SpecConfig | None = None,
            draft_path: str = ""):
    """Every prompt greedily in one batch, the first speculative (with `spec`) and the
    others plain: each request's tokens, and the first one's metrics."""
    opts = {"device": "cpu"} if engine == "torch" else {}
    target = create_engine(engine, model.config, model.weights, **opts)
    draft = None if spec is None else create_draft_engine(
        spec.method, engine, model, target, spec.draft_layers, spec.draft_checkpoint, **opts)
    rt = InferenceRuntime(target, model.tokenizer,
                          RuntimeConfig(max_batch=len(prompts), max_seq=128, spec=spec), draft)
    rt.preallocate()
    try:
        for i, ids in enumerate(prompts):
            rt.submit(GenerationRequest(f"r{i}", ids, resolve(
                rt.config.sampling, temperature=0.0, max_new_tokens=max_new),
                ignore_eos=True, disable_spec_decode=i > 0))
        got, first = {}, None
        while rt.has_work:
            for ev in rt.step():
                got.setdefault(ev.request_id, []).extend(ev.token_ids)
                if ev.request_id == "r0" and ev.metrics is not None:
                    first = ev.metrics
        assert rt.pages.num_free == rt.pages.num_pages
        return got, first
    finally:
        rt.close()


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


@pytest.mark.parametrize(("engine", "spec"), [
    ("numpy", SpecConfig("ngram", 6)),
    # a third of SmolLM2 as its draft stays below break-even: kept on, its output checked
    ("numpy", SpecConfig("self", 4, draft_layers=10, min_accepted_per_step=0.0)),
    ("torch", SpecConfig("ngram", 4)),
], ids=["numpy-ngram", "numpy-self", "torch-ngram"])
def test_smollm2_speculative_greedy_is_plain_greedy(smollm2, engine, spec):
    m = smollm2
    text = m.chat_template.render([{"role": "user", "content":
                                    f"Repeat this passage word for word:\n\n{PASSAGE}"}])
    prompts = [m.tokenizer.encode(text, add_bos=False),
               m.tokenizer.encode(m.chat_template.render(
                   [{"role": "user", "content": "Name three colours."}]), add_bos=False)]
    plain, _ = _greedy(m, engine, prompts, 32)
    got, metrics = _greedy(m, engine, prompts, 32, spec)
    assert got == plain
    assert metrics.accepted_tokens > 0


@pytest.mark.parametrize("engine", ["numpy", "torch"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_hf_speculative_greedy_is_plain_greedy(arch, engine, tmp_path):
    build_hf_model(arch, tmp_path / arch, seed=5)
    model = load_model(tmp_path / arch)
    prompts = [[5, 17, 99, 42, 7, 250, 31, 8, 5, 17, 99], [64, 12, 3, 3, 9]]
    plain, _ = _greedy(model, engine, prompts, 40)
    for spec in (SpecConfig("ngram", 3), SpecConfig("self", 4, draft_layers=1),
                 SpecConfig("draft", 4, draft_checkpoint=str(tmp_path / arch))):
        got, metrics = _greedy(model, engine, prompts, 40, spec)
        assert got == plain, spec.method
        assert metrics.proposed_tokens > 0, spec.method
        if spec.method == "draft":  # the model as its own draft
            assert metrics.acceptance_rate == 1.0
