"""stories260K on the numpy engine reproduces llama2.c's recorded greedy outputs exactly."""

from __future__ import annotations

from llm_runner_svc.runtime import FinishReason, GenerationRequest, resolve


def _greedy(runtime, prompt_ids, max_new):
    sampling = resolve(runtime.config.sampling, temperature=0.0, max_new_tokens=max_new)
    tokens, text, last = [], "", None
    for ev in runtime.generate(GenerationRequest("g", prompt_ids, sampling)):
        tokens += ev.token_ids
        text += ev.text
        last = ev
    return tokens, text, last


def test_greedy_from_bos_matches_golden_ids_and_text(runtime, goldens):
    case = next(c for c in goldens["cases"] if c["name"] == "greedy_from_bos")
    tokens, text, last = _greedy(runtime, case["prompt_token_ids"], case["steps"])
    assert tokens == case["generated_token_ids"]
    assert text == case["text"]
    assert last.finish_reason is FinishReason.MAX_LENGTH
    assert last.metrics.generated_tokens == case["steps"]


def test_dragon_prompt_matches_golden_text(runtime, stories, goldens):
    case = next(c for c in goldens["cases"] if c["name"] == "greedy_dragon")
    ids = stories.tokenizer.encode(case["prompt"])
    assert ids[0] == 1
    # llama2.c's `steps` counts positions from BOS: steps - len(prompt) + 1 tokens are generated
    _, text, _ = _greedy(runtime, ids, case["steps"] - len(ids) + 1)
    printed_prompt = stories.tokenizer.decode(ids[1:], after_bos=True)
    assert printed_prompt == case["prompt"]
    assert printed_prompt + text == case["text"]
