from google.protobuf import struct_pb2 as _struct_pb2
from llm_stage_client._contract.llmstage.v1 import stage_pb2 as _stage_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request", "sinks")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    SINKS_FIELD_NUMBER: _ClassVar[int]
    request: _stage_pb2.GenerationRequest
    sinks: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request: _Optional[_Union[_stage_pb2.GenerationRequest, _Mapping]] = ..., sinks: _Optional[_Iterable[str]] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("stage_id", "port", "token_ids", "text", "logprobs", "prompt_logprobs")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    stage_id: str
    port: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_stage_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_stage_pb2.TokenLogprob]
    def __init__(self, stage_id: _Optional[str] = ..., port: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_stage_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_stage_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class FinalReport(_message.Message):
    __slots__ = ("request_id", "finish_reason", "error", "usage", "diagnostics", "route")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSTICS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finish_reason: _stage_pb2.FinishReason
    error: str
    usage: Usage
    diagnostics: _struct_pb2.Struct
    route: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., finish_reason: _Optional[_Union[_stage_pb2.FinishReason, str]] = ..., error: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., diagnostics: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., route: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("delta", "final")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    delta: Delta
    final: FinalReport
    def __init__(self, delta: _Optional[_Union[Delta, _Mapping]] = ..., final: _Optional[_Union[FinalReport, _Mapping]] = ...) -> None: ...

class CancelGenerateRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelGenerateResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class TopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("endpoint", "healthy", "in_flight")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    healthy: bool
    in_flight: int
    def __init__(self, endpoint: _Optional[str] = ..., healthy: _Optional[bool] = ..., in_flight: _Optional[int] = ...) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("id", "runner", "emits", "inputs", "on_missing", "replicas", "served_model_name")
    ID_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    EMITS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    ON_MISSING_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    id: str
    runner: str
    emits: _containers.RepeatedScalarFieldContainer[str]
    inputs: _containers.RepeatedScalarFieldContainer[str]
    on_missing: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    served_model_name: str
    def __init__(self, id: _Optional[str] = ..., runner: _Optional[str] = ..., emits: _Optional[_Iterable[str]] = ..., inputs: _Optional[_Iterable[str]] = ..., on_missing: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ..., served_model_name: _Optional[str] = ...) -> None: ...

class TopologyResponse(_message.Message):
    __slots__ = ("stages", "sinks", "default_sinks", "max_running", "max_queued", "running", "queued", "runs", "step_streams", "stream_members")
    STAGES_FIELD_NUMBER: _ClassVar[int]
    SINKS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SINKS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    STEP_STREAMS_FIELD_NUMBER: _ClassVar[int]
    STREAM_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[StageInfo]
    sinks: _containers.RepeatedScalarFieldContainer[str]
    default_sinks: _containers.RepeatedScalarFieldContainer[str]
    max_running: int
    max_queued: int
    running: int
    queued: int
    runs: int
    step_streams: int
    stream_members: int
    def __init__(self, stages: _Optional[_Iterable[_Union[StageInfo, _Mapping]]] = ..., sinks: _Optional[_Iterable[str]] = ..., default_sinks: _Optional[_Iterable[str]] = ..., max_running: _Optional[int] = ..., max_queued: _Optional[int] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., runs: _Optional[int] = ..., step_streams: _Optional[int] = ..., stream_members: _Optional[int] = ...) -> None: ...
