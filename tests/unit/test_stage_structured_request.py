"""Structured output, penalties, min_p and log-probabilities on the stage: the wire request as a
StageRequest, what is malformed (INVALID_ARGUMENT), what admission refuses and why, and the
runtime request Prepare builds."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from llm_runner_svc.codec import constraint_from_pb, request_from_pb
from llm_runner_svc.engines import create_engine
from llm_runner_svc.errors import FailedPrecondition, InvalidArgument, Unimplemented
from llm_runner_svc.models.model import Model
from llm_runner_svc.runtime import InferenceRuntime, RuntimeConfig, SamplingDefaults
from llm_runner_svc.runtime.constraint import Constraint
from llm_runner_svc.stage import StageConfig, StageRequest, load_stage_config
from llm_runner_svc.stage.admission import (
    Refusal,
    Refused,
    build_runtime_request,
    check_constraint,
    check_features,
    check_limits,
    check_request,
)
from llm_runner_svc.stage.limits import RequestLimits
from llm_runner_svc.stage.runner_keys import ConfigError
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.stage.slot import Slot


def _wire(**kw: object) -> pb.GenerationRequest:
    sampling = {k: kw.pop(k) for k in ("presence_penalty", "frequency_penalty",
                                        "repetition_penalty", "min_p", "temperature")
                if k in kw}
    return pb.GenerationRequest(text="Hi", sampling=pb.SamplingOverrides(**sampling), **kw)


def test_new_fields_convert_and_unset_ones_stay_none() -> None:
    req = request_from_pb(1, _wire(presence_penalty=0.5, frequency_penalty=-0.25,
                                   repetition_penalty=1.5, min_p=0.125, logprobs=3,
                                   prompt_logprobs=0,
                                   structured_output=pb.StructuredOutput(regex="[ab]+")))
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty,
            req.min_p) == (0.5, -0.25, 1.5, 0.125)
    assert (req.logprobs, req.prompt_logprobs) == (3, 0)
    assert req.constraint == Constraint("regex", "[ab]+")
    plain = request_from_pb(1, _wire())
    assert (plain.presence_penalty, plain.frequency_penalty, plain.repetition_penalty,
            plain.min_p, plain.logprobs, plain.prompt_logprobs, plain.constraint) == (None,) * 7


@pytest.mark.parametrize("so,want", [
    (pb.StructuredOutput(json_schema='{"type": "object"}'),
     Constraint("json_schema", '{"type": "object"}')),
    (pb.StructuredOutput(json_object=True), Constraint("json_object")),
    (pb.StructuredOutput(json_object=False), None),  # false is the same as unset
    (pb.StructuredOutput(), None),
    (pb.StructuredOutput(grammar='start: "yes" | "no"'),
     Constraint("grammar", 'start: "yes" | "no"')),
    (pb.StructuredOutput(choice=pb.ChoiceList(choices=["red", "green"])),
     Constraint("choice", ("red", "green"))),
], ids=["json_schema", "json_object", "json_object_false", "unset", "grammar", "choice"])
def test_each_kind_of_structured_output(so: pb.StructuredOutput,
                                         want: Constraint | None) -> None:
    assert constraint_from_pb(so) == want


@pytest.mark.parametrize("wire,needle", [
    (_wire(structured_output=pb.StructuredOutput(choice=pb.ChoiceList())), "at least one"),
    (_wire(structured_output=pb.StructuredOutput(choice=pb.ChoiceList(choices=["a", ""]))),
     "empty strings"),
    (_wire(structured_output=pb.StructuredOutput(regex="")), "regex is empty"),
    (_wire(structured_output=pb.StructuredOutput(json_schema="")), "json_schema is empty"),
    (_wire(presence_penalty=math.nan), "sampling.presence_penalty must be a finite"),
    (_wire(min_p=math.inf), "sampling.min_p must be a finite"),
], ids=["no_choices", "empty_choice", "empty_regex", "empty_schema", "nan_penalty", "inf_min_p"])
def test_malformed_is_invalid_argument(wire: pb.GenerationRequest, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        request_from_pb(1, wire)


@pytest.mark.parametrize("kw,needle", [
    (dict(presence_penalty=2.5), "presence_penalty must be in"),
    (dict(frequency_penalty=-3.0), "frequency_penalty must be in"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be"),
    (dict(min_p=1.5), "min_p must be in"),
    (dict(logprobs=21), "logprobs must be in 0..20"),
    (dict(prompt_logprobs=-1), "prompt_logprobs must be in 0..20"),
], ids=["presence", "frequency", "repetition", "min_p", "logprobs", "prompt_logprobs"])
def test_out_of_range_is_refused_naming_the_field(stories, kw: dict, needle: str) -> None:
    with pytest.raises(Refused) as info:
        check_request(StageConfig(), stories, 64, StageRequest("r", text="Hi", **kw), 0)
    assert info.value.refusal is Refusal.SAMPLING_OUT_OF_RANGE
    assert needle in info.value.reason


def test_in_range_values_are_admitted(stories) -> None:
    check_request(StageConfig(), stories, 64, StageRequest(
        "r", text="Hi", presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1.2,
        min_p=1.0, logprobs=20, prompt_logprobs=0), 0)


def test_a_schema_over_max_grammar_bytes_is_refused_before_it_compiles() -> None:
    limits = RequestLimits(max_grammar_bytes=16)
    check_limits(limits, 64, StageRequest("r", text="Hi",
                                          constraint=Constraint("regex", "é" * 8)))
    with pytest.raises(Refused) as info:
        check_limits(limits, 64, StageRequest("r", text="Hi",
                                              constraint=Constraint("regex", "é" * 8 + "x")))
    assert info.value.refusal is Refusal.STRUCTURED_OUTPUT
    assert "17 bytes" in info.value.reason and "maxGrammarBytes" in info.value.reason
    choices = Constraint("choice", ("a" * 10, "b" * 10))  # the choices count together
    with pytest.raises(Refused, match="20 bytes"):
        check_limits(limits, 64, StageRequest("r", text="Hi", constraint=choices))
    assert RequestLimits().max_grammar_bytes == 64 << 10


class _Checker:
    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.seen: list[Constraint] = []

    def check_constraint(self, constraint: Constraint) -> None:
        self.seen.append(constraint)
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("error", [
    InvalidArgument("structured output regex does not compile: unbalanced parenthesis"),
    Unimplemented("the onnx engine cannot mask tokens"),
    FailedPrecondition("no token masks on a speculative build"),
], ids=["does_not_compile", "unimplemented", "failed_precondition"])
def test_a_constraint_the_runtime_cannot_serve_is_refused_with_its_reason(
        error: Exception) -> None:
    checker = _Checker(error)
    constraint = Constraint("regex", "(ab")
    with pytest.raises(Refused) as info:
        check_constraint(checker, constraint)
    assert info.value.refusal is Refusal.STRUCTURED_OUTPUT
    assert info.value.reason.startswith("structured output")  # said once
    assert info.value.reason.count("structured output") == 1
    assert str(error) in info.value.reason
    assert checker.seen == [constraint]
    check_constraint(_Checker(None), constraint)


def test_the_runtime_request_carries_every_new_field() -> None:
    constraint = Constraint("choice", ("yes", "no"))
    req = StageRequest("r", token_ids=(1, 2, 3), seed=7, presence_penalty=0.5,
                       frequency_penalty=0.25, repetition_penalty=1.1, min_p=0.05,
                       logprobs=2, prompt_logprobs=1, constraint=constraint)
    runtime = SimpleNamespace(config=SimpleNamespace(sampling=SamplingDefaults()))
    run = build_runtime_request(runtime, Slot(4, req, admitted=(1, 2, 3)))
    sp = run.request.sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_p,
            sp.logprobs, sp.prompt_logprobs, sp.seed) == (0.5, 0.25, 1.1, 0.05, 2, 1, 7)
    assert run.request.constraint == constraint
    plain = build_runtime_request(runtime, Slot(5, StageRequest("p", token_ids=(1,)),
                                                admitted=(1,))).request
    assert (plain.sampling.presence_penalty, plain.sampling.repetition_penalty,
            plain.sampling.min_p, plain.sampling.logprobs, plain.constraint) == \
        (0.0, 1.0, 0.0, None, None)


def runtime_without_features(model: Model, able: bool) -> InferenceRuntime:
    """A real runtime over the numpy engine, its engine's supports_* flags set to `able`."""
    engine = create_engine("numpy", model.config, model.weights)
    for flag in ("supports_logprobs", "supports_scores", "supports_penalties"):
        setattr(engine, flag, able)
    return InferenceRuntime(engine, model.tokenizer, RuntimeConfig())


@pytest.mark.parametrize("kw,needle", [
    (dict(logprobs=0), "logprobs: engine numpy gives no log-probabilities"),
    (dict(prompt_logprobs=2), "prompt_logprobs: engine numpy gives no prompt"),
    (dict(presence_penalty=0.5), "penalties, min_p: engine numpy applies no"),
    (dict(min_p=0.1), "penalties, min_p: engine numpy applies no"),
], ids=["logprobs", "prompt_logprobs", "penalty", "min_p"])
def test_what_the_engine_cannot_give_is_refused_at_admit(stories: Model, kw: dict,
                                                         needle: str) -> None:
    with pytest.raises(Refused) as info:
        check_features(runtime_without_features(stories, False),
                       StageRequest("r", text="Hi", **kw))
    assert info.value.refusal is Refusal.SAMPLING_OUT_OF_RANGE
    assert needle in info.value.reason
    check_features(runtime_without_features(stories, True), StageRequest("r", text="Hi", **kw))


def test_values_that_leave_a_feature_off_ask_nothing_of_the_engine(stories: Model) -> None:
    check_features(runtime_without_features(stories, False),
                   StageRequest("r", text="Hi", presence_penalty=0.0, frequency_penalty=0.0,
                                repetition_penalty=1.0, min_p=0.0))


def test_max_grammar_bytes_is_a_stage_key(tmp_path) -> None:
    path = tmp_path / "stage.json"
    path.write_text(json.dumps({"stages": [{"id": "s", "runner": "llm.backbone",
                                            "maxGrammarBytes": 1024}]}))
    assert load_stage_config(path).limits.max_grammar_bytes == 1024
    path.write_text(json.dumps({"stages": [{"id": "s", "runner": "llm.backbone",
                                            "maxGrammarBytes": 0}]}))
    with pytest.raises(ConfigError, match="maxGrammarBytes: must be an integer >= 1"):
        load_stage_config(path)
