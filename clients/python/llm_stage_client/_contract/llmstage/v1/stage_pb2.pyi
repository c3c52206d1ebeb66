from google.protobuf import struct_pb2 as _struct_pb2
from llm_stage_client._contract.llmstage.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SlotState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLOT_STATE_UNSPECIFIED: _ClassVar[SlotState]
    SLOT_STATE_ADMITTED: _ClassVar[SlotState]
    SLOT_STATE_PREPARED: _ClassVar[SlotState]
    SLOT_STATE_RUNNING: _ClassVar[SlotState]
    SLOT_STATE_FINISHED: _ClassVar[SlotState]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_END_OF_SEQUENCE: _ClassVar[FinishReason]
    FINISH_REASON_MAX_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_WORDS: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class Refusal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_UNSPECIFIED: _ClassVar[Refusal]
    REFUSAL_PROMPT_TOO_LONG: _ClassVar[Refusal]
    REFUSAL_NO_CAPACITY: _ClassVar[Refusal]
    REFUSAL_SAMPLING_OUT_OF_RANGE: _ClassVar[Refusal]
    REFUSAL_UNKNOWN_ADAPTER: _ClassVar[Refusal]
    REFUSAL_MEDIA_UNSUPPORTED: _ClassVar[Refusal]
    REFUSAL_PORT_UNAVAILABLE: _ClassVar[Refusal]
    REFUSAL_TOKEN_OUT_OF_VOCAB: _ClassVar[Refusal]
    REFUSAL_NO_CHAT_TEMPLATE: _ClassVar[Refusal]
    REFUSAL_MEDIA_INVALID: _ClassVar[Refusal]
    REFUSAL_STRUCTURED_OUTPUT: _ClassVar[Refusal]

class CacheLookupPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_LOOKUP_POLICY_UNSPECIFIED: _ClassVar[CacheLookupPolicy]
    CACHE_LOOKUP_POLICY_USE_CACHE: _ClassVar[CacheLookupPolicy]
    CACHE_LOOKUP_POLICY_BYPASS: _ClassVar[CacheLookupPolicy]

class CacheCommitPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_COMMIT_POLICY_UNSPECIFIED: _ClassVar[CacheCommitPolicy]
    CACHE_COMMIT_POLICY_INCLUDING_GENERATED_TOKENS: _ClassVar[CacheCommitPolicy]
    CACHE_COMMIT_POLICY_PREFILL_STATE_ONLY: _ClassVar[CacheCommitPolicy]

class MemberStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_STATUS_UNSPECIFIED: _ClassVar[MemberStatus]
    MEMBER_STATUS_RUNNING: _ClassVar[MemberStatus]
    MEMBER_STATUS_ENDED: _ClassVar[MemberStatus]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_GRPC_BYTES: _ClassVar[Transport]
    TRANSPORT_SHARED_MEMORY: _ClassVar[Transport]
SLOT_STATE_UNSPECIFIED: SlotState
SLOT_STATE_ADMITTED: SlotState
SLOT_STATE_PREPARED: SlotState
SLOT_STATE_RUNNING: SlotState
SLOT_STATE_FINISHED: SlotState
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_END_OF_SEQUENCE: FinishReason
FINISH_REASON_MAX_LENGTH: FinishReason
FINISH_REASON_STOP_WORDS: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
REFUSAL_UNSPECIFIED: Refusal
REFUSAL_PROMPT_TOO_LONG: Refusal
REFUSAL_NO_CAPACITY: Refusal
REFUSAL_SAMPLING_OUT_OF_RANGE: Refusal
REFUSAL_UNKNOWN_ADAPTER: Refusal
REFUSAL_MEDIA_UNSUPPORTED: Refusal
REFUSAL_PORT_UNAVAILABLE: Refusal
REFUSAL_TOKEN_OUT_OF_VOCAB: Refusal
REFUSAL_NO_CHAT_TEMPLATE: Refusal
REFUSAL_MEDIA_INVALID: Refusal
REFUSAL_STRUCTURED_OUTPUT: Refusal
CACHE_LOOKUP_POLICY_UNSPECIFIED: CacheLookupPolicy
CACHE_LOOKUP_POLICY_USE_CACHE: CacheLookupPolicy
CACHE_LOOKUP_POLICY_BYPASS: CacheLookupPolicy
CACHE_COMMIT_POLICY_UNSPECIFIED: CacheCommitPolicy
CACHE_COMMIT_POLICY_INCLUDING_GENERATED_TOKENS: CacheCommitPolicy
CACHE_COMMIT_POLICY_PREFILL_STATE_ONLY: CacheCommitPolicy
MEMBER_STATUS_UNSPECIFIED: MemberStatus
MEMBER_STATUS_RUNNING: MemberStatus
MEMBER_STATUS_ENDED: MemberStatus
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_GRPC_BYTES: Transport
TRANSPORT_SHARED_MEMORY: Transport

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PortSpec(_message.Message):
    __slots__ = ("name", "dtype", "width")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _tensor_pb2.DType
    width: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., width: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "format", "architecture", "vocab_size", "hidden_size", "num_layers", "max_position", "has_chat_template")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    format: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position: int
    has_chat_template: bool
    def __init__(self, name: _Optional[str] = ..., format: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., max_position: _Optional[int] = ..., has_chat_template: _Optional[bool] = ...) -> None: ...

class SamplingDefaults(_message.Message):
    __slots__ = ("max_generate_length", "temperature", "top_p", "top_k")
    MAX_GENERATE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    max_generate_length: int
    temperature: float
    top_p: float
    top_k: int
    def __init__(self, max_generate_length: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("contract_version", "stage_id", "runner", "emits", "inputs", "max_batch", "max_seq", "max_step_window", "engine", "model", "sampling_defaults", "lora_adapters", "max_loras")
    CONTRACT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    EMITS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_WINDOW_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    contract_version: str
    stage_id: str
    runner: str
    emits: _containers.RepeatedCompositeFieldContainer[PortSpec]
    inputs: _containers.RepeatedScalarFieldContainer[str]
    max_batch: int
    max_seq: int
    max_step_window: int
    engine: str
    model: ModelInfo
    sampling_defaults: SamplingDefaults
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    max_loras: int
    def __init__(self, contract_version: _Optional[str] = ..., stage_id: _Optional[str] = ..., runner: _Optional[str] = ..., emits: _Optional[_Iterable[_Union[PortSpec, _Mapping]]] = ..., inputs: _Optional[_Iterable[str]] = ..., max_batch: _Optional[int] = ..., max_seq: _Optional[int] = ..., max_step_window: _Optional[int] = ..., engine: _Optional[str] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., sampling_defaults: _Optional[_Union[SamplingDefaults, _Mapping]] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., max_loras: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("lora_adapters",)
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("lora_adapters",)
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class ChatPart(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: int
    def __init__(self, text: _Optional[str] = ..., image: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "parts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    parts: _containers.RepeatedCompositeFieldContainer[ChatPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ChatPart, _Mapping]]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class MediaPart(_message.Message):
    __slots__ = ("mime_type", "data")
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    mime_type: str
    data: bytes
    def __init__(self, mime_type: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class SamplingOverrides(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "max_tokens", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    max_tokens: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "choice")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: ChoiceList
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerationRequest(_message.Message):
    __slots__ = ("request_id", "text", "messages", "token_ids", "sampling", "stop", "logit_bias", "lora", "ports", "media", "ignore_eos", "context_cache_lookup_policy", "context_cache_commit_policy", "disable_spec_decode", "structured_output", "logprobs", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_CACHE_LOOKUP_POLICY_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_CACHE_COMMIT_POLICY_FIELD_NUMBER: _ClassVar[int]
    DISABLE_SPEC_DECODE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    messages: ChatMessages
    token_ids: TokenIds
    sampling: SamplingOverrides
    stop: _containers.RepeatedScalarFieldContainer[str]
    logit_bias: _containers.ScalarMap[int, float]
    lora: str
    ports: _containers.RepeatedScalarFieldContainer[str]
    media: _containers.RepeatedCompositeFieldContainer[MediaPart]
    ignore_eos: bool
    context_cache_lookup_policy: CacheLookupPolicy
    context_cache_commit_policy: CacheCommitPolicy
    disable_spec_decode: bool
    structured_output: StructuredOutput
    logprobs: int
    prompt_logprobs: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingOverrides, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., lora: _Optional[str] = ..., ports: _Optional[_Iterable[str]] = ..., media: _Optional[_Iterable[_Union[MediaPart, _Mapping]]] = ..., ignore_eos: _Optional[bool] = ..., context_cache_lookup_policy: _Optional[_Union[CacheLookupPolicy, str]] = ..., context_cache_commit_policy: _Optional[_Union[CacheCommitPolicy, str]] = ..., disable_spec_decode: _Optional[bool] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("slot_id", "request", "traceparent")
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    slot_id: int
    request: GenerationRequest
    traceparent: str
    def __init__(self, slot_id: _Optional[int] = ..., request: _Optional[_Union[GenerationRequest, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class AdmitResponse(_message.Message):
    __slots__ = ("admitted", "refusal", "reason", "prompt_tokens")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    admitted: bool
    refusal: Refusal
    reason: str
    prompt_tokens: int
    def __init__(self, admitted: _Optional[bool] = ..., refusal: _Optional[_Union[Refusal, str]] = ..., reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class InputBinding(_message.Message):
    __slots__ = ("input", "endpoint", "request_id")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    input: str
    endpoint: str
    request_id: str
    def __init__(self, input: _Optional[str] = ..., endpoint: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("slot_id", "inputs")
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    slot_id: int
    inputs: _containers.RepeatedCompositeFieldContainer[InputBinding]
    def __init__(self, slot_id: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[InputBinding, _Mapping]]] = ...) -> None: ...

class PrepareResponse(_message.Message):
    __slots__ = ("prompt_tokens", "sampling", "seed")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    sampling: SamplingDefaults
    seed: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingDefaults, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("join", "credits", "member_credits")
    JOIN_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_CREDITS_FIELD_NUMBER: _ClassVar[int]
    join: _containers.RepeatedScalarFieldContainer[int]
    credits: int
    member_credits: _containers.RepeatedCompositeFieldContainer[MemberCredit]
    def __init__(self, join: _Optional[_Iterable[int]] = ..., credits: _Optional[int] = ..., member_credits: _Optional[_Iterable[_Union[MemberCredit, _Mapping]]] = ...) -> None: ...

class MemberCredit(_message.Message):
    __slots__ = ("slot_id", "credits")
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    slot_id: int
    credits: int
    def __init__(self, slot_id: _Optional[int] = ..., credits: _Optional[int] = ...) -> None: ...

class MemberUpdate(_message.Message):
    __slots__ = ("slot_id", "status", "token_ids", "text", "finish_reason", "error", "logprobs", "prompt_logprobs")
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    slot_id: int
    status: MemberStatus
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    error: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, slot_id: _Optional[int] = ..., status: _Optional[_Union[MemberStatus, str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., error: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class JoinRefusal(_message.Message):
    __slots__ = ("slot_id", "code", "message")
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    slot_id: int
    code: str
    message: str
    def __init__(self, slot_id: _Optional[int] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class StepEvent(_message.Message):
    __slots__ = ("step", "members", "refused")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    step: int
    members: _containers.RepeatedCompositeFieldContainer[MemberUpdate]
    refused: _containers.RepeatedCompositeFieldContainer[JoinRefusal]
    def __init__(self, step: _Optional[int] = ..., members: _Optional[_Iterable[_Union[MemberUpdate, _Mapping]]] = ..., refused: _Optional[_Iterable[_Union[JoinRefusal, _Mapping]]] = ...) -> None: ...

class RequestMetrics(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "queue_ms", "prefill_ms", "decode_ms", "ttft_ms", "tokens_per_s")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    ttft_ms: float
    tokens_per_s: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., tokens_per_s: _Optional[float] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("slot_id", "reason")
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    slot_id: int
    reason: FinishReason
    def __init__(self, slot_id: _Optional[int] = ..., reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class FinishResponse(_message.Message):
    __slots__ = ("slot_id", "finish_reason", "error", "output_token_ids", "output_text", "metrics")
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TEXT_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    slot_id: int
    finish_reason: FinishReason
    error: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_text: str
    metrics: RequestMetrics
    def __init__(self, slot_id: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., error: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., output_text: _Optional[str] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("slot_id",)
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    slot_id: int
    def __init__(self, slot_id: _Optional[int] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class DiagnosticsRequest(_message.Message):
    __slots__ = ("slot_id",)
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    slot_id: int
    def __init__(self, slot_id: _Optional[int] = ...) -> None: ...

class DiagnosticsResponse(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _struct_pb2.Struct
    def __init__(self, values: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("slot_id",)
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    slot_id: int
    def __init__(self, slot_id: _Optional[int] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("state", "was_running")
    STATE_FIELD_NUMBER: _ClassVar[int]
    WAS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    state: SlotState
    was_running: bool
    def __init__(self, state: _Optional[_Union[SlotState, str]] = ..., was_running: _Optional[bool] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("request_id", "all_requests", "port", "transport")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ALL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    all_requests: bool
    port: str
    transport: Transport
    def __init__(self, request_id: _Optional[str] = ..., all_requests: _Optional[bool] = ..., port: _Optional[str] = ..., transport: _Optional[_Union[Transport, str]] = ...) -> None: ...

class ShmSlice(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ShmRegion(_message.Message):
    __slots__ = ("name", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class HiddenStates(_message.Message):
    __slots__ = ("start_position", "token_ids", "embeddings", "states", "embeddings_shm", "states_shm", "is_prefill")
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_SHM_FIELD_NUMBER: _ClassVar[int]
    STATES_SHM_FIELD_NUMBER: _ClassVar[int]
    IS_PREFILL_FIELD_NUMBER: _ClassVar[int]
    start_position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    embeddings: _tensor_pb2.Tensor
    states: _tensor_pb2.Tensor
    embeddings_shm: ShmSlice
    states_shm: ShmSlice
    is_prefill: bool
    def __init__(self, start_position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., embeddings: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., states: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., embeddings_shm: _Optional[_Union[ShmSlice, _Mapping]] = ..., states_shm: _Optional[_Union[ShmSlice, _Mapping]] = ..., is_prefill: _Optional[bool] = ...) -> None: ...

class PortEnd(_message.Message):
    __slots__ = ("finish_reason", "error")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    error: str
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., error: _Optional[str] = ...) -> None: ...

class SubscribeEvent(_message.Message):
    __slots__ = ("request_id", "seq", "hidden", "end", "region", "subscribed", "batch", "steps")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBED_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    hidden: HiddenStates
    end: PortEnd
    region: ShmRegion
    subscribed: Subscribed
    batch: EventBatch
    steps: StepBatches
    def __init__(self, request_id: _Optional[str] = ..., seq: _Optional[int] = ..., hidden: _Optional[_Union[HiddenStates, _Mapping]] = ..., end: _Optional[_Union[PortEnd, _Mapping]] = ..., region: _Optional[_Union[ShmRegion, _Mapping]] = ..., subscribed: _Optional[_Union[Subscribed, _Mapping]] = ..., batch: _Optional[_Union[EventBatch, _Mapping]] = ..., steps: _Optional[_Union[StepBatches, _Mapping]] = ...) -> None: ...

class StepBatches(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[EventBatch]
    def __init__(self, steps: _Optional[_Iterable[_Union[EventBatch, _Mapping]]] = ...) -> None: ...

class HiddenBlock(_message.Message):
    __slots__ = ("request_ids", "seqs", "positions", "token_ids", "embeddings", "states", "embeddings_shm", "states_shm")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_SHM_FIELD_NUMBER: _ClassVar[int]
    STATES_SHM_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    seqs: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    embeddings: _tensor_pb2.Tensor
    states: _tensor_pb2.Tensor
    embeddings_shm: ShmSlice
    states_shm: ShmSlice
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., seqs: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., embeddings: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., states: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., embeddings_shm: _Optional[_Union[ShmSlice, _Mapping]] = ..., states_shm: _Optional[_Union[ShmSlice, _Mapping]] = ...) -> None: ...

class Subscribed(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("events", "decode_rows")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ROWS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[SubscribeEvent]
    decode_rows: HiddenBlock
    def __init__(self, events: _Optional[_Iterable[_Union[SubscribeEvent, _Mapping]]] = ..., decode_rows: _Optional[_Union[HiddenBlock, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("request", "add_special_tokens", "stage_id")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    request: GenerationRequest
    add_special_tokens: bool
    stage_id: str
    def __init__(self, request: _Optional[_Union[GenerationRequest, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., stage_id: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "max_seq", "vocab_size", "bos_token", "eos_token", "model", "chat_template")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_seq: int
    vocab_size: int
    bos_token: str
    eos_token: str
    model: str
    chat_template: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., max_seq: _Optional[int] = ..., vocab_size: _Optional[int] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., model: _Optional[str] = ..., chat_template: _Optional[str] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "stage_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    stage_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., stage_id: _Optional[str] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...
