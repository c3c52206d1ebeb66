"""Completions through the gateway on the embedded stories260K model with the `openai`
package: log-probabilities (and the echo lm-evaluation-harness scores prompts with), n
choices, the penalties and min_p, constraints; and the 400s that name a field."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from deployment import Deployment
from http_gateway import LONG, GatewayProc, sse
from openai import OpenAI

PROMPT = "Once upon a time"
IDS = [1, 403, 407]  # token ids of the embedded model's vocabulary


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    dep = Deployment(tmp_path_factory.mktemp("outputs"), {"backbone": {"maxSeq": 512}})
    gw = GatewayProc(dep.target)
    yield OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=LONG)
    gw.stop()
    dep.close()


def url(api: OpenAI, route: str) -> str:
    return f"{str(api.base_url).rstrip('/')}/{route}"


def test_completion_logprobs_have_openais_shape(api) -> None:
    got = api.completions.create(model="backbone", prompt=PROMPT, max_tokens=6, temperature=0,
                                 logprobs=3)
    lp = got.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == got.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value is not None and value <= 0 and 3 <= len(top) <= 4
        assert top[token] == value  # the token itself is among them
        assert max(top.values()) == pytest.approx(value)  # greedy: it was the likeliest


def test_streamed_completion_logprobs_go_with_their_chunks(api) -> None:
    whole = api.completions.create(model="backbone", prompt=PROMPT, max_tokens=8,
                                   temperature=0, logprobs=1)
    chunks = list(api.completions.create(model="backbone", prompt=PROMPT, max_tokens=8,
                                         temperature=0, logprobs=1, stream=True))
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in chunks:
        lp = chunk.choices[0].logprobs
        if lp is not None and lp.tokens:
            tokens += lp.tokens
            offsets += lp.text_offset or []
    assert whole.choices[0].logprobs is not None
    assert tokens == whole.choices[0].logprobs.tokens
    assert offsets == whole.choices[0].logprobs.text_offset


def test_echo_scores_a_prompt_as_lm_eval_does(api) -> None:
    # lm-eval's local-completions loglikelihood: token ids, echo, max_tokens 1, logprobs 1;
    # it sums token_logprobs[ctxlen:-1] and drops the generated last one
    got = api.completions.create(model="backbone", prompt=IDS, max_tokens=1, echo=True,
                                 logprobs=1, temperature=0)
    lp = got.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(IDS) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.tokens is not None
    prompt_text = got.choices[0].text[:len(got.choices[0].text) - len(lp.tokens[-1])]
    # max_tokens 0: the prompt and its log-probabilities only, the same values
    only = api.completions.create(model="backbone", prompt=IDS, max_tokens=0, echo=True,
                                  logprobs=1)
    assert only.choices[0].text == prompt_text and only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs is not None
    assert only.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:-1])
    assert only.usage is not None and only.usage.completion_tokens == 0
    status, events = sse(url(api, "completions"), {"model": "backbone", "prompt": IDS,
                                                   "max_tokens": 0, "echo": True,
                                                   "logprobs": 1})
    assert status == 200 and events[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == prompt_text
    streamed = [v for c in events[:-1] if c["choices"][0]["logprobs"]
                for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:-1])


def test_a_prompt_logprob_is_the_logprob_of_generating_that_token(api) -> None:
    generated = api.completions.create(model="backbone", prompt=PROMPT, max_tokens=4,
                                       temperature=0, logprobs=0).choices[0]
    echoed = api.completions.create(model="backbone", prompt=PROMPT + generated.text,
                                    max_tokens=0, echo=True, logprobs=0).choices[0]
    assert generated.logprobs is not None and echoed.logprobs is not None
    assert echoed.text == PROMPT + generated.text
    assert echoed.logprobs.tokens is not None and generated.logprobs.tokens is not None
    assert echoed.logprobs.tokens[-4:] == generated.logprobs.tokens  # tokenized alike
    assert echoed.logprobs.token_logprobs is not None
    assert echoed.logprobs.token_logprobs[-4:] == pytest.approx(
        generated.logprobs.token_logprobs, abs=1e-3)


def test_n_choices_are_the_seeded_singles(api) -> None:
    ask: dict[str, Any] = {"model": "backbone", "prompt": PROMPT, "max_tokens": 12,
                           "temperature": 1.5}
    got = api.completions.create(**ask, n=3, seed=7)
    assert [c.index for c in got.choices] == [0, 1, 2]
    alone = [api.completions.create(**ask, seed=7 + i) for i in range(3)]
    singles = [one.choices[0].text for one in alone]
    assert [c.text for c in got.choices] == singles
    assert len(set(singles)) > 1  # the seeds differ, so do the choices
    assert got.usage is not None and all(one.usage is not None for one in alone)
    assert got.usage.completion_tokens == sum(one.usage.completion_tokens
                                              for one in alone if one.usage)
    assert got.usage.prompt_tokens == alone[0].usage.prompt_tokens
    stream = list(api.completions.create(**ask, n=3, seed=7, stream=True,
                                         stream_options={"include_usage": True}))
    texts = ["", "", ""]
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert texts == singles and finished == {0, 1, 2}
    assert stream[-1].usage is not None and stream[-1].usage.model_dump() == \
        got.usage.model_dump()
    batch = api.completions.create(model="backbone", prompt=[PROMPT, "The dog"],
                                   max_tokens=4, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text != batch.choices[2].text
    assert batch.choices[2].text == batch.choices[3].text


def test_penalties_and_min_p_change_the_output_as_asked(api) -> None:
    ask: dict[str, Any] = {"model": "backbone", "prompt": PROMPT, "max_tokens": 48,
                           "temperature": 0}
    plain = api.completions.create(**ask).choices[0].text
    assert api.completions.create(**ask, frequency_penalty=2.0).choices[0].text != plain
    assert api.completions.create(**ask, presence_penalty=2.0).choices[0].text != plain
    assert api.completions.create(**ask, extra_body={"repetition_penalty": 2.0}
                                  ).choices[0].text != plain
    # neutral values change nothing
    assert api.completions.create(**ask, frequency_penalty=0, presence_penalty=0, extra_body={
        "repetition_penalty": 1.0, "min_p": 0}).choices[0].text == plain
    # min_p 1 keeps only the likeliest token: sampling at temperature 1 is greedy
    sampled = api.completions.create(model="backbone", prompt=PROMPT, max_tokens=48,
                                     temperature=1.0, seed=3, extra_body={"min_p": 1.0})
    assert sampled.choices[0].text == plain


def test_constraints_hold_on_completions(api) -> None:
    got = api.completions.create(model="backbone", prompt=PROMPT, max_tokens=12,
                                 extra_body={"guided_regex": "[a-z]+( [a-z]+)*"})
    assert re.fullmatch("[a-z]+( [a-z]+)*", got.choices[0].text) or \
        got.choices[0].finish_reason == "length"
    for body in ({"guided_choice": ["yes", "no"]},
                 {"structured_outputs": {"choice": ["yes", "no"]}},
                 {"guided_grammar": 'start: "yes" | "no"'}):
        got = api.completions.create(model="backbone", prompt=PROMPT, max_tokens=8,
                                     extra_body=body)
        assert got.choices[0].text in ("yes", "no"), body


def test_a_constraint_the_stage_cannot_compile_is_400_naming_its_field(api) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="backbone", prompt=PROMPT, max_tokens=4,
                               extra_body={"guided_regex": "(unclosed"})
    assert info.value.param == "guided_regex"


@pytest.mark.parametrize("extra, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"extra_body": {"repetition_penalty": -1}}, "repetition_penalty"),
    ({"extra_body": {"min_p": 2}}, "min_p"),
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"suffix": " The end."}, "suffix"),
    ({"logprobs": 21}, "logprobs"),
    ({"extra_body": {"guided_regex": "a+", "guided_choice": ["a"]}}, "guided_choice"),
    ({"extra_body": {"response_format": {"type": "json_object"}, "guided_json": {}}},
     "guided_json"),
    ({"extra_body": {"reasoning_effort": "low"}}, "reasoning_effort"),
])
def test_out_of_range_and_unhonoured_fields_are_400_naming_them(api, extra, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="backbone", prompt=PROMPT, max_tokens=4, **extra)
    assert info.value.status_code == 400 and info.value.param == param, info.value.body
    assert param in info.value.message


def test_two_constraints_name_both(api) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(
            model="backbone", messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})
    assert info.value.status_code == 400 and info.value.param == "guided_regex"
    assert "response_format" in info.value.message and "guided_regex" in info.value.message
