"""The Orchestrator API's messages <-> the orchestrator's domain types.

Only this module and the servicer (service.py) touch `orchestrator_pb2`; the domain (core.py,
run.py) works on the types here. The stage's own messages (`stage_pb2`) stay with the code that
calls the stages (run.py, cohorts.py): the prompt and sampling of a request travel to every
stage as the `GenerationRequest` the caller sent, which the orchestrator never interprets
beyond its request id and which prompt field is set. Enum values map through tables, never
through their proto names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from google.protobuf import struct_pb2

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.errors import InvalidArgument
from services.orchestrator.topology import Topology


class FinishReason(Enum):
    """Why a request ended; the value is its name in metrics and traces."""

    UNSPECIFIED = "unspecified"
    END_OF_SEQUENCE = "end_of_sequence"
    MAX_LENGTH = "max_length"
    STOP_WORDS = "stop_words"
    CANCELLED = "cancelled"
    ERROR = "error"


_FINISH_TO_PB: dict[FinishReason, pb.FinishReason] = {
    FinishReason.UNSPECIFIED: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.END_OF_SEQUENCE: pb.FINISH_REASON_END_OF_SEQUENCE,
    FinishReason.MAX_LENGTH: pb.FINISH_REASON_MAX_LENGTH,
    FinishReason.STOP_WORDS: pb.FINISH_REASON_STOP_WORDS,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_FINISH_FROM_PB: dict[int, FinishReason] = {v: k for k, v in _FINISH_TO_PB.items()}


def finish_reason_from_pb(value: int) -> FinishReason:
    """A FinishReason enum value (of a stage's answer); one this build does not know is
    UNSPECIFIED."""
    return _FINISH_FROM_PB.get(value, FinishReason.UNSPECIFIED)


def finish_reason_to_pb(reason: FinishReason) -> pb.FinishReason:
    return _FINISH_TO_PB[reason]


@dataclass(frozen=True)
class GenerateInput:
    """One Generate call as the orchestrator sees it."""

    request: pb.GenerationRequest  # forwarded to each stage (with its ports and the id set)
    sinks: tuple[str, ...]  # "stage:port"; empty = the topology's default sinks

    @property
    def request_id(self) -> str:
        """The caller's id; "" when the orchestrator is to assign one."""
        return self.request.request_id

    @property
    def prompt_field(self) -> str:
        """Which prompt field is set ("text", "messages", "token_ids"); "" when none."""
        return self.request.WhichOneof("prompt") or ""

    @classmethod
    def from_pb(cls, msg: opb.GenerateRequest) -> GenerateInput:
        if not msg.HasField("request"):
            raise InvalidArgument("GenerateRequest.request is required")
        request = pb.GenerationRequest()
        request.CopyFrom(msg.request)
        return cls(request, tuple(msg.sinks))


@dataclass(frozen=True)
class Delta:
    """New output of one sink port: one or more steps' tokens and their text, and, when the
    request asked, their log-probabilities (one per token id) and the prompt's (once). The
    log-probabilities are the stage's messages, relayed as they came."""

    stage_id: str
    port: str
    token_ids: list[int]
    text: str
    logprobs: Sequence[pb.TokenLogprob] = ()
    prompt_logprobs: Sequence[pb.TokenLogprob] = ()

    def to_pb(self) -> opb.GenerateEvent:
        delta = opb.Delta(stage_id=self.stage_id, port=self.port, token_ids=self.token_ids,
                          text=self.text)
        if self.logprobs:
            delta.logprobs.extend(self.logprobs)
        if self.prompt_logprobs:
            delta.prompt_logprobs.extend(self.prompt_logprobs)
        return opb.GenerateEvent(delta=delta)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0  # of the first stage on the route
    completion_tokens: int = 0  # of the first sink stage


@dataclass(frozen=True)
class FinalReport:
    """The end of a request: the last event of its stream."""

    request_id: str
    finish_reason: FinishReason
    route: tuple[str, ...]  # active stages in route order
    error: str = ""
    usage: Usage = field(default_factory=Usage)
    diagnostics: dict[str, Any] = field(default_factory=dict)  # stage id -> its keys

    def to_pb(self) -> opb.GenerateEvent:
        diagnostics = struct_pb2.Struct()
        diagnostics.update(self.diagnostics)
        return opb.GenerateEvent(final=opb.FinalReport(
            request_id=self.request_id, finish_reason=finish_reason_to_pb(self.finish_reason),
            error=self.error, usage=opb.Usage(prompt_tokens=self.usage.prompt_tokens,
                                              completion_tokens=self.usage.completion_tokens),
            diagnostics=diagnostics, route=list(self.route)))


Event = Delta | FinalReport  # what a Generate stream carries


@dataclass(frozen=True)
class ReplicaReport:
    endpoint: str
    is_healthy: bool
    in_flight: int  # requests it serves for this orchestrator now


@dataclass(frozen=True)
class TopologyReport:
    """What is deployed (the topology, each stage's replicas) and what the orchestrator holds
    now: `state` has the counts of TopologyResponse (running, queued, runs, step_streams,
    stream_members)."""

    topology: Topology
    replicas: dict[str, tuple[ReplicaReport, ...]]  # stage id -> its replicas
    state: dict[str, int]

    def to_pb(self) -> opb.TopologyResponse:
        t = self.topology
        return opb.TopologyResponse(
            stages=[opb.StageInfo(
                id=s.stage_id, runner=s.runner, emits=list(s.emits), inputs=list(s.inputs),
                on_missing=s.on_missing, served_model_name=s.served_model_name or "",
                replicas=[opb.ReplicaInfo(endpoint=r.endpoint, healthy=r.is_healthy,
                                          in_flight=r.in_flight)
                          for r in self.replicas[s.stage_id]]) for s in t.stages],
            sinks=list(t.sinks), default_sinks=list(t.default_sinks),
            max_running=t.max_running, max_queued=t.max_queued, **self.state)
