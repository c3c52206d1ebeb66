"""Speculation below break-even turns itself off per request (`spec_decode.
min_accepted_per_step` after `acceptance_warmup_steps` verify steps): a request whose
proposals are never accepted stops proposing after the warm-up and decodes plainly, with
plain greedy decoding's tokens, and says so in its metrics and Diagnostics; a request whose
proposals are accepted keeps speculating to its end."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict
from helpers import drain_with_metrics, solo
from stage_harness import StageServer

from llm_runner_svc.engines import create_engine
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.runtime import (
    GenerationRequest,
    InferenceRuntime,
    RuntimeConfig,
    SpecConfig,
    resolve,
)
from llm_runner_svc.runtime.speculative import StatelessProposer, losing_reason
from llm_runner_svc.stage import StageConfig
from llm_runner_svc.stage.config import ConfigError, load_stage_config
from services.contract.llmstage.v1 import stage_pb2 as pb

PROMPTS = {"wrong": "Once upon a time", "right": "The cat sat"}
MAX_TOKENS = 40
K = 4


class ScriptedProposer(StatelessProposer):
    """Proposes K tokens of the plain greedy continuation: all of them right for requests
    named "right", every one of them wrong for the others; counts what each was asked."""

    def __init__(self, config: SpecConfig, plain: dict[str, list[int]]) -> None:
        super().__init__(config)
        self.plain = plain
        self.asked: dict[str, int] = {}

    def propose_batch(self, seqs: Sequence[Any], ks: Sequence[int]) -> list[list[int]]:
        out = []
        for seq, k in zip(seqs, ks, strict=True):
            rid, done = seq.req.request_id, len(seq.output_ids)
            self.asked[rid] = self.asked.get(rid, 0) + 1
            tokens = self.plain[rid][done:done + k]
            out.append(tokens if rid == "right" else [t + 1 for t in tokens])
        return out


def _runtime(stories, spec: SpecConfig | None) -> InferenceRuntime:
    rt = InferenceRuntime(create_engine("numpy", stories.config, stories.weights),
                          stories.tokenizer,
                          RuntimeConfig(max_batch=2, max_seq=256, max_tokens_per_step=128,
                                        spec=spec))
    rt.preallocate()
    return rt


def _run(stories, spec: SpecConfig | None, plain: dict[str, list[int]] | None = None
         ) -> tuple[dict[str, list[int]], dict[str, Any], ScriptedProposer | None]:
    rt = _runtime(stories, spec)
    proposer = None
    if spec is not None:
        assert plain is not None
        proposer = ScriptedProposer(spec, plain)
        rt.proposer = proposer  # type: ignore[assignment]
    try:
        for rid, text in PROMPTS.items():
            ids = stories.tokenizer.encode(text, add_bos=True)
            rt.submit(GenerationRequest(rid, ids, resolve(
                rt.config.sampling, temperature=0.0, max_new_tokens=MAX_TOKENS),
                ignore_eos=True, disable_spec_decode=spec is None))
        got, metrics = drain_with_metrics(rt)
        assert rt.pages.num_free == rt.pages.num_pages
        return got, metrics, proposer
    finally:
        rt.close()


def test_a_request_never_accepted_stops_proposing_and_one_accepted_goes_on(stories):
    plain, _, _ = _run(stories, None)
    spec = SpecConfig(proposal_tokens=K, min_accepted_per_step=0.5, acceptance_warmup_steps=4)
    got, metrics, proposer = _run(stories, spec, plain)
    assert proposer is not None
    assert got == plain  # greedy: plain greedy's tokens, proposing or not

    wrong = metrics["wrong"]
    assert proposer.asked["wrong"] == 4  # the warm-up's verify steps, then never again
    assert (wrong.verify_steps, wrong.proposed_tokens, wrong.accepted_tokens) == (4, 4 * K, 0)
    # the prefill's pick, then one token per rejected verify step; plain decoding after them
    assert wrong.spec_disabled_at_token == 1 + 4
    assert "0 accepted tokens per verify step over 4 steps" in wrong.spec_disabled_reason
    assert "min_accepted_per_step 0.5" in wrong.spec_disabled_reason
    assert wrong.as_dict()["spec_disabled_at_token"] == 5  # on `llm-runner generate`'s line

    right = metrics["right"]
    assert right.spec_disabled_at_token == -1 and right.spec_disabled_reason == ""
    assert "spec_disabled_at_token" not in right.as_dict()
    assert right.accepted_tokens == right.proposed_tokens > 0  # speculated to its end
    assert right.verify_steps == proposer.asked["right"] > 4
    assert right.verify_steps < MAX_TOKENS // 2  # K + 1 tokens a step, not one


def test_zero_keeps_every_request_speculating(stories):
    plain, _, _ = _run(stories, None)
    spec = SpecConfig(proposal_tokens=K, min_accepted_per_step=0.0)
    got, metrics, proposer = _run(stories, spec, plain)
    assert got == plain
    # a proposal before every token but the prefill's and the last (no room for one there)
    assert proposer is not None and proposer.asked["wrong"] == MAX_TOKENS - 2
    assert metrics["wrong"].verify_steps == MAX_TOKENS - 2
    assert metrics["wrong"].spec_disabled_reason == ""


def test_the_rule_waits_for_the_warm_up_and_compares_the_mean():
    spec = SpecConfig(proposal_tokens=8, min_accepted_per_step=0.25, acceptance_warmup_steps=4)
    assert losing_reason(spec, 3, 0) == ""  # still warming up
    assert losing_reason(spec, 4, 0) != ""
    assert losing_reason(spec, 8, 1) != ""  # 0.125 a step
    assert losing_reason(spec, 8, 2) == ""  # 0.25: break-even is enough
    assert losing_reason(SpecConfig(min_accepted_per_step=0.0), 100, 0) == ""


@pytest.mark.parametrize(("kw", "message"), [
    (dict(min_accepted_per_step=-0.1), "min_accepted_per_step must be in [0, 4]"),
    (dict(min_accepted_per_step=5.0), "min_accepted_per_step must be in [0, 4]"),
    (dict(acceptance_warmup_steps=0), "acceptance_warmup_steps must be 1 or more"),
])
def test_bad_values_are_refused(kw, message):
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        SpecConfig(proposal_tokens=4, **kw)


def test_the_keys_are_read_from_the_stage_file_and_checked(tmp_path):
    def load(spec: dict[str, Any]) -> Any:
        path = tmp_path / "stage.json"
        path.write_text(json.dumps({"stages": [{"id": "s", "runner": "llm.backbone",
                                                "config": {"spec_decode": spec}}]}))
        return load_stage_config(path).spec

    spec = load({"method": "ngram", "min_accepted_per_step": 1, "acceptance_warmup_steps": 8})
    assert (spec.min_accepted_per_step, spec.acceptance_warmup_steps) == (1.0, 8)
    default = load({"method": "ngram"})
    assert (default.min_accepted_per_step, default.acceptance_warmup_steps) == (0.25, 8)
    with pytest.raises(ConfigError, match="config.spec_decode.min_accepted_per_step: must be "
                                          "a number >= 0, got 'x'"):
        load({"min_accepted_per_step": "x"})
    with pytest.raises(ConfigError, match="config.spec_decode.acceptance_warmup_steps: must "
                                          "be an integer >= 1, got 0"):
        load({"acceptance_warmup_steps": 0})
    with pytest.raises(ConfigError, match=r"spec_decode.min_accepted_per_step must be in "
                                          r"\[0, 4\]"):
        load({"min_accepted_per_step": 4.5})


def test_the_stage_reports_it_in_diagnostics(stories):
    """Over real gRPC, a stage whose rule asks every verify step to accept all K tokens:
    ngram's proposals on the embedded model fall short, so the request decodes plainly after
    its warm-up with plain greedy decoding's tokens, and Diagnostics says from which token
    and why."""
    text = "Lily and Tom went to the park. Lily and Tom went to the park. Lily and Tom"
    request = dict(text=text, temperature=0.0, max_tokens=80, ignore_eos=True)
    plain = solo(stories, request)[0]
    config = StageConfig(max_seq=512, spec=SpecConfig("ngram", 4, min_accepted_per_step=4.0,
                                                      acceptance_warmup_steps=2))
    with StageServer(config) as srv:
        srv.admit_prepare(1, **request)
        stream = srv.step([1], credits=256)
        assert stream.collect({1})[1]["tokens"] == plain
        srv.stub.Finish(pb.FinishRequest(slot_id=1))
        diag = MessageToDict(srv.stub.Diagnostics(pb.DiagnosticsRequest(slot_id=1)).values)
        srv.stub.Reset(pb.ResetRequest(slot_id=1))
        stream.half_close()
    assert diag["proposed_tokens"] > 0
    assert 0 < diag["spec_disabled_at_token"] < 80
    assert "below min_accepted_per_step 4" in diag["spec_disabled_reason"]
