"""Structured output, penalties and log-probabilities through the runtime, on the numpy and
torch (CPU) engines with the embedded model: constrained outputs parse and validate, also
across chunked prefill, preemption, the prefix cache and speculative decoding (proposals
verified under the constraint's masks); penalties
and log-probabilities equal what a hand-written loop over the engine's logits gives."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import numpy as np
import pytest

from llm_runner_svc.engines import create_engine
from llm_runner_svc.engines.base import DecodeRow, EnginePlan
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models.model import Model
from llm_runner_svc.runtime import (
    FinishReason,
    GenerationRequest,
    InferenceRuntime,
    RuntimeConfig,
    SpecConfig,
    resolve,
)
from llm_runner_svc.runtime.constraint import Constraint

ENGINES = ["numpy", "torch"]

ORDER = {
    "type": "object",
    "properties": {
        "item": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
        "express": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "blue", "big"]}, "maxItems": 3},
    },
    "required": ["item", "count", "express", "tags"],
    "additionalProperties": False,
}


def runtime(model: Model, engine: str, pages: int = 0, **cfg: object) -> InferenceRuntime:
    """A preallocated runtime; `pages`: a KV pool of that many pages (0: the default)."""
    eng = create_engine(engine, model.config, model.weights)
    if pages:
        cfg["kv_memory_bytes"] = pages * int(cfg.get("page_size", 16)) * \
            eng.kv_bytes_per_token()  # type: ignore[call-overload]
    rt = InferenceRuntime(eng, model.tokenizer, RuntimeConfig(**cfg))  # type: ignore[arg-type]
    rt.preallocate()
    return rt


@pytest.fixture(params=ENGINES)
def rt(request: pytest.FixtureRequest, stories: Model) -> Iterator[InferenceRuntime]:
    r = runtime(stories, request.param, max_batch=8, max_seq=256)
    yield r
    r.close()


def request(model: Model, rid: str, constraint: Constraint | None = None,
            prompt: str = "The shop order was", **sampling: object) -> GenerationRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_new_tokens", 120)
    return GenerationRequest(rid, model.tokenizer.encode(prompt),
                             resolve(_DEFAULTS, **sampling),  # type: ignore[arg-type]
                             constraint=constraint)


_DEFAULTS = RuntimeConfig().sampling


def drain(rt: InferenceRuntime) -> dict[str, dict]:
    out: dict[str, dict] = {}
    while rt.has_work:
        for ev in rt.step():
            o = out.setdefault(ev.request_id, {"ids": [], "text": "", "logprobs": [],
                                               "prompt": None, "end": None, "error": None})
            o["ids"] += ev.token_ids
            o["text"] += ev.text
            o["logprobs"] += ev.logprobs
            if ev.prompt_logprobs is not None:
                assert o["prompt"] is None, "prompt log-probabilities come once"
                o["prompt"] = ev.prompt_logprobs
            if ev.finish_reason is not None:
                o["end"], o["error"], o["metrics"] = ev.finish_reason, ev.error, ev.metrics
    return out


def run(rt: InferenceRuntime, *reqs: GenerationRequest) -> dict[str, dict]:
    for r in reqs:
        rt.submit(r)
    return drain(rt)


def assert_valid_order(o: dict) -> None:
    assert o["end"] is FinishReason.END_OF_SEQUENCE, (o["end"], o["error"], o["text"])
    jsonschema.validate(json.loads(o["text"]), ORDER)


JSON_ORDER = Constraint("json_schema", json.dumps(ORDER))


def test_json_schema_output_validates_greedy_and_sampled(rt: InferenceRuntime,
                                                         stories: Model) -> None:
    reqs = [request(stories, "greedy", JSON_ORDER)] + [
        request(stories, f"s{i}", JSON_ORDER, temperature=1.0, top_p=1.0, top_k=0, seed=i)
        for i in range(5)]
    out = run(rt, *reqs)
    for o in out.values():
        assert_valid_order(o)
    assert len({o["text"] for o in out.values()}) > 1, "sampled outputs differ"


def test_without_the_constraint_the_model_writes_no_json(rt: InferenceRuntime,
                                                         stories: Model) -> None:
    o = run(rt, request(stories, "free"))["free"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(o["text"])


def test_regex_choice_and_grammar(rt: InferenceRuntime, stories: Model) -> None:
    out = run(rt, request(stories, "re", Constraint("regex", "[0-9]{3}-[a-z]{2,4}")),
              request(stories, "ch", Constraint("choice", ("cat", "dog", "bird")),
                      temperature=1.0, seed=3),
              request(stories, "gr", Constraint("grammar",
                                                'start: "(" n ("+" n)* ")"\nn: /[1-9]/')))
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", out["re"]["text"])
    assert out["ch"]["text"] in ("cat", "dog", "bird")
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", out["gr"]["text"])
    assert all(o["end"] is FinishReason.END_OF_SEQUENCE for o in out.values())


def test_constrained_rows_beside_free_ones_leave_them_unchanged(rt: InferenceRuntime,
                                                                stories: Model) -> None:
    alone = run(rt, request(stories, "free", max_new_tokens=30))["free"]
    mixed = run(rt, request(stories, "free", max_new_tokens=30),
                request(stories, "json", JSON_ORDER))
    assert mixed["free"]["ids"] == alone["ids"]
    assert_valid_order(mixed["json"])


@pytest.mark.parametrize("engine", ENGINES)
def test_chunked_prefill_preemption_and_cache_keep_the_output(stories: Model,
                                                              engine: str) -> None:
    names = ["Tom", "Lily", "Ben", "Sue"]
    reqs = [request(stories, n, JSON_ORDER, prompt=f"{n} had a little shop. " * 6)
            for n in names]
    ref_rt = runtime(stories, engine, max_batch=4, max_seq=256)
    ref = run(ref_rt, *reqs)
    ref_rt.close()
    for o in ref.values():
        assert_valid_order(o)
    # small chunks, a pool for two requests at a time (preemptions), a prefix cache
    rt = runtime(stories, engine, pages=14, max_batch=4, max_seq=256, prefill_chunk=16,
                 page_size=16, prefix_cache=True)
    out = run(rt, *reqs)
    run(rt, reqs[0])
    again = run(rt, reqs[0])  # its prompt's pages named by the run before
    assert rt.scheduler.preemptions > 0
    rt.close()
    for n in names:
        assert out[n]["ids"] == ref[n]["ids"], n
    assert again["Tom"]["ids"] == ref["Tom"]["ids"]
    assert again["Tom"]["metrics"].cached_tokens > 0


@pytest.mark.parametrize("engine", ENGINES)
def test_speculative_deployment_verifies_constrained_proposals(stories: Model,
                                                               engine: str) -> None:
    # the prompt holds documents of the schema, so prompt lookup proposes their tokens
    prompt = '{"item":"cake","count":3,"express":true,"tags":["red","big"]} ' * 3
    greedy = request(stories, "g", JSON_ORDER, prompt=prompt)
    sampled = [request(stories, f"s{i}", JSON_ORDER, prompt=prompt, temperature=1.0,
                       top_k=0, top_p=1.0, seed=i) for i in range(3)]
    plain_rt = runtime(stories, engine, max_batch=4, max_seq=256)
    ref = run(plain_rt, greedy)["g"]
    plain_rt.close()
    rt = runtime(stories, engine, max_batch=4, max_seq=256,
                 spec=SpecConfig(method="ngram", proposal_tokens=4))
    out = run(rt, greedy, *sampled)
    rt.close()
    assert out["g"]["ids"] == ref["ids"], "greedy verification gives plain decoding's tokens"
    assert out["g"]["metrics"].proposed_tokens > 0
    assert sum(o["metrics"].accepted_tokens for o in out.values()) > 0
    for o in out.values():
        assert_valid_order(o)


def test_a_constraint_that_does_not_compile_is_refused(rt: InferenceRuntime,
                                                       stories: Model) -> None:
    with pytest.raises(InvalidArgument, match="unclosed"):
        rt.submit(request(stories, "bad", Constraint("regex", "(unclosed")))
    assert not rt.has_work


# ---- against a loop of our own over the engine's logits ------------------------------------

def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


class Reference:
    """One request decoded by hand: the engine's raw logits after each position."""

    def __init__(self, model: Model, engine: str, prompt: list[int]) -> None:
        self.engine = create_engine(engine, model.config, model.weights)
        self.engine.preallocate(EnginePlan(max_batch=1, max_seq=256, page_size=16,
                                           num_pages=16))
        self.pages = list(range(16))
        self.pos = 0
        self.prompt_logits = []
        for t in prompt:  # one position at a time: the logits after each prompt token
            self.feed(t)
            self.prompt_logits.append(self.logits)

    def feed(self, token: int) -> None:
        if self.pos == 0:
            self.engine.prefill([token], 0, self.pages)
        else:
            self.engine.decode([DecodeRow(token, self.pos, self.pages)])
        self.pos += 1
        self.logits = np.array(self.engine.logits(1)[0], dtype=np.float32)


@pytest.mark.parametrize("engine", ENGINES)
def test_penalised_greedy_picks_equal_a_hand_written_loop(stories: Model, engine: str) -> None:
    presence, frequency, repetition = 0.7, 0.4, 1.3
    prompt = stories.tokenizer.encode("Tom and Tom saw a dog. The dog")
    ref = Reference(stories, engine, prompt)
    counts: dict[int, int] = {}
    expected = []
    for _ in range(24):
        x = ref.logits.astype(np.float64).copy()
        for t in set(prompt) | set(counts):
            x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
        for t, c in counts.items():
            x[t] -= frequency * c + presence
        pick = int(np.argmax(x))
        expected.append(pick)
        counts[pick] = counts.get(pick, 0) + 1
        ref.feed(pick)
    rt = runtime(stories, engine, max_batch=2, max_seq=256)
    req = GenerationRequest("p", prompt, resolve(
        _DEFAULTS, temperature=0.0, max_new_tokens=24, presence_penalty=presence,
        frequency_penalty=frequency, repetition_penalty=repetition), ignore_eos=True)
    got = run(rt, req)["p"]["ids"]
    unpenalised = run(rt, GenerationRequest("u", prompt, resolve(
        _DEFAULTS, temperature=0.0, max_new_tokens=24), ignore_eos=True))["u"]["ids"]
    rt.close()
    assert got == expected
    assert got != unpenalised, "the penalties changed the output"


@pytest.mark.parametrize("engine", ENGINES)
def test_logprobs_are_log_softmax_of_the_logits_that_picked(stories: Model,
                                                            engine: str) -> None:
    prompt = stories.tokenizer.encode("Lily found a red ball")
    rt = runtime(stories, engine, max_batch=2, max_seq=256)
    o = run(rt, GenerationRequest("lp", prompt, resolve(
        _DEFAULTS, temperature=0.9, top_p=1.0, top_k=0, seed=11, max_new_tokens=12,
        logprobs=5, prompt_logprobs=3), ignore_eos=True))["lp"]
    rt.close()
    assert len(o["logprobs"]) == len(o["ids"]) == 12
    ref = Reference(stories, engine, prompt)
    for tok, lp in zip(o["ids"], o["logprobs"], strict=True):
        want = log_softmax(ref.logits)
        assert lp.token_id == tok
        assert abs(lp.logprob - want[tok]) < 1e-4
        top = np.argsort(-want, kind="stable")[:5]
        assert [t for t, _ in lp.top] == top.tolist()
        assert np.allclose([v for _, v in lp.top], want[top], atol=1e-4)
        ref.feed(tok)
    scores = o["prompt"]
    assert scores is not None and len(scores) == len(prompt) - 1
    for i, s in enumerate(scores):
        want = log_softmax(ref.prompt_logits[i])
        assert s.token_id == prompt[i + 1]
        assert abs(s.logprob - want[prompt[i + 1]]) < 1e-4
        assert len(s.top) == 3 and s.top[0][0] == int(np.argmax(want))


def test_min_p_keeps_only_likely_tokens(rt: InferenceRuntime, stories: Model) -> None:
    prompt = stories.tokenizer.encode("Once upon a time")
    out = run(rt, *[GenerationRequest(f"m{i}", prompt, resolve(
        _DEFAULTS, temperature=1.0, top_p=1.0, top_k=0, min_p=0.5, seed=i, max_new_tokens=1,
        logprobs=1), ignore_eos=True) for i in range(12)])
    for o in out.values():
        lp = o["logprobs"][0]
        best = lp.top[0][1]
        assert lp.logprob >= best + np.log(0.5) - 1e-5  # p >= 0.5 * p_max
