"""SmolLM2-135M-Instruct (GGUF, Q4_1) answers chat prompts in fluent English.

The pinned ids are what this engine produced when the test was written; the texts were
read and judged fluent then. A change to the GGUF loader, tokenizer, template or engine
that alters them needs a look, not a re-pin.
"""

from __future__ import annotations

import pytest
from helpers import make_runtime

from llm_runner_svc.models import load_model
from llm_runner_svc.runtime import FinishReason, GenerationRequest, SamplingDefaults, resolve


@pytest.fixture(scope="module")
def smol_runtime():
    model = load_model("smollm2")
    rt = make_runtime(model, max_batch=2, max_seq=256)
    yield model, rt
    rt.close()


def _chat(model, rt, question: str, max_new: int = 60):
    prompt = model.chat_template.render([{"role": "user", "content": question}])
    ids = model.tokenizer.encode(prompt, add_bos=False)
    sampling = resolve(SamplingDefaults(), temperature=0.0, max_new_tokens=max_new)
    events = list(rt.generate(GenerationRequest("chat", ids, sampling)))
    return ([t for ev in events for t in ev.token_ids], "".join(ev.text for ev in events),
            events[-1])


def test_chat_template_renders_chatml(smol_runtime):
    model, _ = smol_runtime
    text = model.chat_template.render([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_first_twenty_greedy_tokens_are_pinned(smol_runtime):
    model, rt = smol_runtime
    tokens, text, last = _chat(model, rt, "Write one sentence about the sea.")
    assert tokens[:20] == [504, 3426, 314, 253, 4749, 284, 11965, 7815, 28, 30055, 351, 1029,
                           284, 551, 1719, 281, 624, 1038, 970, 28]
    assert model.tokenizer.decode(tokens[:20]) == (
        "The sea is a vast and mysterious realm, teeming with life and unending in its own way,")
    assert last.finish_reason is FinishReason.END_OF_SEQUENCE  # ends its turn with <|im_end|>
    assert text.endswith("the unending beauty of the universe.")


def test_answers_a_factual_question(smol_runtime):
    model, rt = smol_runtime
    _, text, last = _chat(model, rt, "What is the capital of France?")
    assert text == "The capital of France is Paris."
    assert last.finish_reason is FinishReason.END_OF_SEQUENCE
