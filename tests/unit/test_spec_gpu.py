"""Speculative decoding on a CUDA GPU with the torch engine (CUDA graphs, Triton kernels):
verify rows as decode rows of the decode graphs' verify variants (torch_steps.py), or through
the captured prefill graphs where a step also prefills.

float32 on the GPU gives plain greedy decoding's tokens exactly with every proposer (ngram,
self, draft), alone and in a mixed batch beside plain requests, every page back in both
pools. In bf16 a verify step's products may round otherwise than a decode step's, so there
the target as its own draft must have (nearly) every proposal accepted: a verify head that
read the wrong positions would accept next to none. These tests need a GPU; CI has none, and
benchmarks/gpu_spec.sh runs them on one.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from helpers import drain_with_metrics  # noqa: E402

from llm_runner_svc.engines import create_engine  # noqa: E402
from llm_runner_svc.engines.drafts import create_draft_engine  # noqa: E402
from llm_runner_svc.runtime import (  # noqa: E402
    GenerationRequest,
    InferenceRuntime,
    RuntimeConfig,
    SpecConfig,
    resolve,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = ("Lily and Tom went to the park. Lily and Tom", "The cat sat", "Once upon a time")


def _run(stories, spec, dtype, plain=()):
    opts = {"device": "cuda", "dtype": dtype}
    engine = create_engine("torch", stories.config, stories.weights, **opts)
    draft = None if spec is None else create_draft_engine(
        spec.method, "torch", stories, engine, spec.draft_layers, spec.draft_checkpoint, **opts)
    rt = InferenceRuntime(engine, stories.tokenizer,
                          RuntimeConfig(max_batch=4, max_seq=512, spec=spec), draft)
    rt.preallocate()
    try:
        for i, p in enumerate(PROMPTS):
            rt.submit(GenerationRequest(
                f"r{i}", stories.tokenizer.encode(p, add_bos=True),
                resolve(rt.config.sampling, temperature=0.0, max_new_tokens=120 - 30 * i),
                ignore_eos=True, disable_spec_decode=i in plain))
        got, metrics = drain_with_metrics(rt)
        assert rt.pages.num_free == rt.pages.num_pages
        if spec is not None and spec.method != "ngram":
            assert rt.proposer.pool.num_free == rt.proposer.pool.num_pages
        return got, metrics
    finally:
        rt.close()


@pytest.fixture(scope="module")
def plain_f32(stories):
    return _run(stories, None, "float32")[0]


# the layer-skip draft stays below break-even: kept on here, where its proposals are checked
@pytest.mark.parametrize("spec", [SpecConfig("ngram", 4),
                                  SpecConfig("self", 3, draft_layers=2, min_accepted_per_step=0.0),
                                  SpecConfig("draft", 5, draft_checkpoint="stories260K")],
                         ids=["ngram", "self", "draft"])
def test_speculative_greedy_is_plain_greedy_on_gpu(stories, plain_f32, spec):
    plain = plain_f32
    got, metrics = _run(stories, spec, "float32", plain=(1,))
    assert got == plain
    assert metrics["r0"].accepted_tokens > 0 and metrics["r1"].proposed_tokens == 0


def test_target_as_its_own_draft_is_accepted_in_bf16(stories):
    got, metrics = _run(stories, SpecConfig("draft", 4, draft_checkpoint="stories260K"),
                        "bfloat16")
    for m in metrics.values():
        assert m.acceptance_rate > 0.8, m
        assert m.tokens_per_target_step > 3.0
