from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_CANCELLED: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

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

class SamplingParameters(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "max_new_tokens", "stop", "stop_token_ids", "sampling", "k", "ignore_eos", "request_id", "leaves", "prompt_lookup", "shared_lookup", "stream_interval")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    SHARED_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParameters
    k: int
    ignore_eos: bool
    request_id: str
    leaves: int
    prompt_lookup: int
    shared_lookup: bool
    stream_interval: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParameters, _Mapping]] = ..., k: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., request_id: _Optional[str] = ..., leaves: _Optional[int] = ..., prompt_lookup: _Optional[int] = ..., shared_lookup: _Optional[bool] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "draft_tokens_proposed", "draft_tokens_accepted", "steps", "queue_seconds", "first_token_seconds", "total_seconds")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    draft_tokens_proposed: int
    draft_tokens_accepted: int
    steps: int
    queue_seconds: float
    first_token_seconds: float
    total_seconds: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., draft_tokens_proposed: _Optional[int] = ..., draft_tokens_accepted: _Optional[int] = ..., steps: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., first_token_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "stats")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    stats: RequestStats
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("target_model", "draft_model", "tokenizer", "max_batch_size", "max_queue", "max_new_tokens_limit", "max_context", "k_policy", "profile", "eos_token_id", "version", "totals", "running", "waiting", "replicas", "emulated_acceptance")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    K_POLICY_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    EMULATED_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    draft_model: str
    tokenizer: str
    max_batch_size: int
    max_queue: int
    max_new_tokens_limit: int
    max_context: int
    k_policy: str
    profile: str
    eos_token_id: int
    version: str
    totals: StepTotals
    running: int
    waiting: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    emulated_acceptance: str
    def __init__(self, target_model: _Optional[str] = ..., draft_model: _Optional[str] = ..., tokenizer: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., max_queue: _Optional[int] = ..., max_new_tokens_limit: _Optional[int] = ..., max_context: _Optional[int] = ..., k_policy: _Optional[str] = ..., profile: _Optional[str] = ..., eos_token_id: _Optional[int] = ..., version: _Optional[str] = ..., totals: _Optional[_Union[StepTotals, _Mapping]] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., emulated_acceptance: _Optional[str] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("service", "address", "healthy", "sequences", "failures")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    service: str
    address: str
    healthy: bool
    sequences: int
    failures: int
    def __init__(self, service: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., sequences: _Optional[int] = ..., failures: _Optional[int] = ...) -> None: ...

class StepTotals(_message.Message):
    __slots__ = ("steps", "sequence_steps", "step_seconds", "draft_seconds", "target_seconds", "draft_compute_seconds", "target_compute_seconds", "prefill_seconds", "reached_by_position", "accepted_by_position", "k_histogram", "leaf_chances", "leaf_hits", "lookup_chains", "lookup_drafted", "lookup_accepted", "shared_lookup_chains", "shared_lookup_drafted", "shared_lookup_accepted")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REACHED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    K_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    LEAF_CHANCES_FIELD_NUMBER: _ClassVar[int]
    LEAF_HITS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_CHAINS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SHARED_LOOKUP_CHAINS_FIELD_NUMBER: _ClassVar[int]
    SHARED_LOOKUP_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    SHARED_LOOKUP_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    steps: int
    sequence_steps: int
    step_seconds: float
    draft_seconds: float
    target_seconds: float
    draft_compute_seconds: float
    target_compute_seconds: float
    prefill_seconds: float
    reached_by_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_by_position: _containers.RepeatedScalarFieldContainer[int]
    k_histogram: _containers.RepeatedScalarFieldContainer[int]
    leaf_chances: int
    leaf_hits: int
    lookup_chains: int
    lookup_drafted: int
    lookup_accepted: int
    shared_lookup_chains: int
    shared_lookup_drafted: int
    shared_lookup_accepted: int
    def __init__(self, steps: _Optional[int] = ..., sequence_steps: _Optional[int] = ..., step_seconds: _Optional[float] = ..., draft_seconds: _Optional[float] = ..., target_seconds: _Optional[float] = ..., draft_compute_seconds: _Optional[float] = ..., target_compute_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., reached_by_position: _Optional[_Iterable[int]] = ..., accepted_by_position: _Optional[_Iterable[int]] = ..., k_histogram: _Optional[_Iterable[int]] = ..., leaf_chances: _Optional[int] = ..., leaf_hits: _Optional[int] = ..., lookup_chains: _Optional[int] = ..., lookup_drafted: _Optional[int] = ..., lookup_accepted: _Optional[int] = ..., shared_lookup_chains: _Optional[int] = ..., shared_lookup_drafted: _Optional[int] = ..., shared_lookup_accepted: _Optional[int] = ...) -> None: ...
