"""The OpenAI-compatible gateway in front of a real deployment (stories260K): the `openai`
package and raw HTTP get, streaming or not, the text `llm-stage generate` prints for the same
greedy request; concurrent streams each get their solo text; the models and health routes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from deployment import Deployment
from helpers import solo
from http_gateway import LONG, GatewayProc, joined, llm_stage_generate, request, sse
from openai import OpenAI

from llm_runner_svc.models import Model

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, GatewayProc]]:
    dep = Deployment(tmp_path_factory.mktemp("gw"), {"backbone": {"maxSeq": 512}})
    gw = GatewayProc(dep.target)
    yield dep, gw
    gw.stop()
    dep.close()


def client(gw: GatewayProc) -> OpenAI:
    return OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=LONG)


@pytest.mark.parametrize("extra", [(), ("--stop", "Lily")], ids=["length", "stop"])
def test_completions_give_the_text_of_llm_stage_generate(gateway, extra) -> None:
    dep, gw = gateway
    expected = llm_stage_generate(dep.target, PROMPT, "--temperature", "0", "--max-tokens", "40",
                                  *extra)
    stop = list(extra[1:])
    args: dict[str, Any] = dict(model="backbone", prompt=PROMPT, max_tokens=40, temperature=0,
                                stop=stop or None)
    whole = client(gw).completions.create(**args)
    streamed = list(client(gw).completions.create(**args, stream=True))
    body = {k: v for k, v in args.items() if v is not None}
    status, headers, raw = request(f"{gw.url}/v1/completions", body)
    raw_status, raw_events = sse(f"{gw.url}/v1/completions", body)

    reason = "stop" if stop else "length"
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == reason
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.usage is not None and whole.usage.prompt_tokens == 5
    if not stop:
        assert whole.usage.completion_tokens == 40
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert [c.choices[0].finish_reason for c in streamed][-1] == reason
    assert all(c.choices[0].finish_reason is None for c in streamed[:-1])
    assert status == 200 and raw["choices"][0]["text"] == expected
    assert raw["choices"][0]["stop_reason"] == ("stop_words" if stop else "max_length")
    assert headers["X-Request-Id"] == raw["id"]
    assert raw_status == 200 and raw_events[-1] == "[DONE]" and joined(raw_events) == expected


def test_a_stream_can_end_with_its_usage(gateway) -> None:
    _, gw = gateway
    chunks = list(client(gw).completions.create(
        model="backbone", prompt=PROMPT, max_tokens=7, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (5, 7)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_token_id_prompts_and_the_extensions(gateway) -> None:
    dep, gw = gateway
    expected = llm_stage_generate(dep.target, PROMPT, "--temperature", "0.9", "--top-k", "5",
                                  "--seed", "11", "--max-tokens", "16")
    got = client(gw).completions.create(model="backbone", prompt=PROMPT, max_tokens=16,
                                        temperature=0.9, seed=11, extra_body={"top_k": 5})
    assert got.choices[0].text == expected
    # ignore_eos: the whole budget, whatever the model would end on
    status, _, body = request(f"{gw.url}/v1/completions", {
        "model": "backbone", "prompt": [1, 403, 407], "max_tokens": 60, "temperature": 0,
        "ignore_eos": True})
    assert status == 200 and body["usage"] == {"prompt_tokens": 3, "completion_tokens": 60,
                                               "total_tokens": 63}


def test_sixteen_concurrent_streams_each_get_their_solo_text(gateway, stories: Model) -> None:
    _, gw = gateway
    words = ("a", "the", "one", "two", "red", "big", "old", "sad", "dog", "cat", "sun", "sky",
             "day", "box", "hat", "toy")
    specs = [dict(text=f"{PROMPT} {word}", seed=100 + i, temperature=0.8, top_k=40,
                  max_tokens=20 + i) for i, word in enumerate(words)]
    start = threading.Barrier(len(specs))
    api = client(gw)

    def one(spec: dict[str, Any]) -> tuple[str, str | None]:
        start.wait(LONG)
        chunks = list(api.completions.create(
            model="backbone", prompt=spec["text"], max_tokens=spec["max_tokens"],
            temperature=spec["temperature"], seed=spec["seed"], stream=True,
            extra_body={"top_k": spec["top_k"]}))
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    with ThreadPoolExecutor(len(specs)) as pool:
        results = list(pool.map(one, specs))
    for spec, (text, reason) in zip(specs, results, strict=True):
        _, solo_text, solo_reason = solo(stories, spec)
        assert text == solo_text, spec
        assert reason == {"max_length": "length"}.get(solo_reason, "stop")


def test_models_and_health(gateway) -> None:
    _, gw = gateway
    models = client(gw).models.list()
    assert [m.id for m in models] == ["backbone"]
    assert client(gw).models.retrieve("backbone").id == "backbone"
    status, _, body = request(f"{gw.url}/health")
    assert status == 200 and body["status"] == "ok"
