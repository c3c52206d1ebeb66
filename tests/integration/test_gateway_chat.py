"""Chat through the gateway on SmolLM2-135M-Instruct (its chat template on the stage): the
`openai` package and raw HTTP, streaming or not, get the greedy text the orchestrator gives
the same conversation, and a completion the text `llm-stage generate` prints."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from deployment import Deployment
from http_gateway import LONG, GatewayProc, joined, llm_stage_generate, request, sse
from llm_stage_client import Client
from openai import OpenAI

QUESTION = "What is the capital of France?"
SYSTEM = "You answer in one short sentence."


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, GatewayProc]]:
    dep = Deployment(tmp_path_factory.mktemp("smol"),  # loading takes seconds
                     {"backbone": {"artifact": "smollm2", "maxSeq": 512, "maxBatch": 4}})
    gw = GatewayProc(dep.target)
    yield dep, gw
    gw.stop()
    dep.close()


def test_chat_gives_the_orchestrators_text(smol) -> None:
    dep, gw = smol
    with Client(dep.target, timeout=LONG) as direct:
        expected, report = direct.generate_text(
            messages=[("system", SYSTEM), ("user", QUESTION)], temperature=0, max_tokens=24)
    assert "Paris" in expected
    api = OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=LONG)
    messages = [{"role": "developer", "content": SYSTEM},
                {"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    whole = api.chat.completions.create(model="backbone", messages=messages,  # type: ignore[arg-type]
                                        temperature=0, max_completion_tokens=24)
    chunks = list(api.chat.completions.create(model="backbone", messages=messages,  # type: ignore[arg-type]
                                              temperature=0, max_tokens=24, stream=True))
    body = {"model": "backbone", "messages": messages, "temperature": 0, "max_tokens": 24}
    status, _, raw = request(f"{gw.url}/v1/chat/completions", body)
    raw_status, raw_events = sse(f"{gw.url}/v1/chat/completions", body)

    choice = whole.choices[0]
    assert choice.message.content == expected and choice.message.role == "assistant"
    assert choice.finish_reason == {"end_of_sequence": "stop", "max_length": "length"}[
        report.finish_reason]
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.usage is not None
    # the gateway's usage counts the end-of-sequence token, as vLLM's does
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        report.prompt_tokens,
        report.completion_tokens + (report.finish_reason == "end_of_sequence"))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].object == "chat.completion.chunk"
    assert status == 200 and raw["choices"][0]["message"]["content"] == expected
    assert raw_status == 200 and raw_events[-1] == "[DONE]" and joined(raw_events) == expected


def test_completion_gives_the_text_of_llm_stage_generate(smol) -> None:
    dep, gw = smol
    prompt = "The three primary colors are"
    expected = llm_stage_generate(dep.target, prompt, "--temperature", "0", "--max-tokens", "16")
    api = OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=LONG)
    got = api.completions.create(model="backbone", prompt=prompt, max_tokens=16, temperature=0)
    assert got.choices[0].text == expected


def test_a_served_model_name_and_its_tokenizer(smol) -> None:
    dep, _ = smol
    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    gw = GatewayProc(dep.target, "--served-model-name", name)
    try:
        api = OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=LONG)
        assert [m.id for m in api.models.list()] == [name]
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        whole = api.chat.completions.create(model=name, messages=messages,  # type: ignore[arg-type]
                                            temperature=0, max_tokens=8)
        assert whole.model == name and whole.usage is not None
        status, _, tokens = request(f"{gw.url}/tokenize", {"model": name, "messages": messages})
        assert status == 200 and tokens["count"] == whole.usage.prompt_tokens
        status, _, text = request(f"{gw.url}/detokenize", {"model": name,
                                                            "tokens": tokens["tokens"]})
        assert text["prompt"].startswith("<|im_start|>system\n" + SYSTEM)
        assert text["prompt"].endswith("<|im_start|>assistant\n")
        status, _, info = request(f"{gw.url}/tokenizer_info")
        assert (info["name_or_path"], info["eos_token"]) == (name, "<|im_end|>")
        assert "<|im_start|>" in info["chat_template"]
        status, _, answer = request(f"{gw.url}/v1/completions", {"model": "backbone",
                                                                  "prompt": "Hi"})
        assert status == 404 and name in answer["error"]["message"]
    finally:
        gw.stop()
