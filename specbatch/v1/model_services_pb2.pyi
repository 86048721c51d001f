from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SequenceInput(_message.Message):
    __slots__ = ("seq_id", "keep_len", "tokens", "features")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    keep_len: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    features: bytes
    def __init__(self, seq_id: _Optional[str] = ..., keep_len: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., features: _Optional[bytes] = ...) -> None: ...

class SequenceLength(_message.Message):
    __slots__ = ("seq_id", "cached_len")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    cached_len: int
    def __init__(self, seq_id: _Optional[str] = ..., cached_len: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceInput]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceInput, _Mapping]]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceLength]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceLength, _Mapping]]] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceLength]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceLength, _Mapping]]] = ...) -> None: ...

class RollbackResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class CacheStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheStatsResponse(_message.Message):
    __slots__ = ("model", "sequences", "cached_tokens", "max_sequences", "max_context", "vocab_size", "feature_size", "sequences_created", "local_socket", "hardware", "weights", "emulated_acceptance", "hosted_draft")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_CREATED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    EMULATED_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    HOSTED_DRAFT_FIELD_NUMBER: _ClassVar[int]
    model: str
    sequences: int
    cached_tokens: int
    max_sequences: int
    max_context: int
    vocab_size: int
    feature_size: int
    sequences_created: int
    local_socket: str
    hardware: str
    weights: str
    emulated_acceptance: str
    hosted_draft: str
    def __init__(self, model: _Optional[str] = ..., sequences: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., max_sequences: _Optional[int] = ..., max_context: _Optional[int] = ..., vocab_size: _Optional[int] = ..., feature_size: _Optional[int] = ..., sequences_created: _Optional[int] = ..., local_socket: _Optional[str] = ..., hardware: _Optional[str] = ..., weights: _Optional[str] = ..., emulated_acceptance: _Optional[str] = ..., hosted_draft: _Optional[str] = ...) -> None: ...

class Sampling(_message.Message):
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

class DraftDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class Leaves(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeItem(_message.Message):
    __slots__ = ("sequence", "k", "sampling", "leaves")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    sequence: SequenceInput
    k: int
    sampling: Sampling
    leaves: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence: _Optional[_Union[SequenceInput, _Mapping]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., leaves: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeItem, _Mapping]]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("seq_id", "tokens", "cached_len", "distributions", "leaves")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    cached_len: int
    distributions: _containers.RepeatedCompositeFieldContainer[DraftDistribution]
    leaves: _containers.RepeatedCompositeFieldContainer[Leaves]
    def __init__(self, seq_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., cached_len: _Optional[int] = ..., distributions: _Optional[_Iterable[_Union[DraftDistribution, _Mapping]]] = ..., leaves: _Optional[_Iterable[_Union[Leaves, _Mapping]]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("proposals", "compute_seconds")
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    compute_seconds: float
    def __init__(self, proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ..., compute_seconds: _Optional[float] = ...) -> None: ...

class ProposeNext(_message.Message):
    __slots__ = ("k", "leaves", "draft")
    K_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    k: int
    leaves: _containers.RepeatedScalarFieldContainer[int]
    draft: SequenceInput
    def __init__(self, k: _Optional[int] = ..., leaves: _Optional[_Iterable[int]] = ..., draft: _Optional[_Union[SequenceInput, _Mapping]] = ...) -> None: ...

class VerifyItem(_message.Message):
    __slots__ = ("sequence", "draft_tokens", "sampling", "draft_distributions", "leaves", "propose_next", "further")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_NEXT_FIELD_NUMBER: _ClassVar[int]
    FURTHER_FIELD_NUMBER: _ClassVar[int]
    sequence: SequenceInput
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    draft_distributions: _containers.RepeatedCompositeFieldContainer[DraftDistribution]
    leaves: _containers.RepeatedCompositeFieldContainer[Leaves]
    propose_next: ProposeNext
    further: FurtherSteps
    def __init__(self, sequence: _Optional[_Union[SequenceInput, _Mapping]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., draft_distributions: _Optional[_Iterable[_Union[DraftDistribution, _Mapping]]] = ..., leaves: _Optional[_Iterable[_Union[Leaves, _Mapping]]] = ..., propose_next: _Optional[_Union[ProposeNext, _Mapping]] = ..., further: _Optional[_Union[FurtherSteps, _Mapping]] = ...) -> None: ...

class FurtherSteps(_message.Message):
    __slots__ = ("max_tokens", "stop_token_ids", "room")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    room: int
    def __init__(self, max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., room: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("items", "create", "return_features", "further_steps")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    FURTHER_STEPS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyItem]
    create: bool
    return_features: bool
    further_steps: int
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyItem, _Mapping]]] = ..., create: _Optional[bool] = ..., return_features: _Optional[bool] = ..., further_steps: _Optional[int] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("seq_id", "accepted", "next_token", "cached_len", "features", "leaf", "proposal")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    LEAF_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    accepted: int
    next_token: int
    cached_len: int
    features: bytes
    leaf: int
    proposal: Proposal
    def __init__(self, seq_id: _Optional[str] = ..., accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., cached_len: _Optional[int] = ..., features: _Optional[bytes] = ..., leaf: _Optional[int] = ..., proposal: _Optional[_Union[Proposal, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("verdicts", "compute_seconds", "draft_compute_seconds", "further_steps")
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FURTHER_STEPS_FIELD_NUMBER: _ClassVar[int]
    verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    compute_seconds: float
    draft_compute_seconds: float
    further_steps: _containers.RepeatedCompositeFieldContainer[StepVerdicts]
    def __init__(self, verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ..., compute_seconds: _Optional[float] = ..., draft_compute_seconds: _Optional[float] = ..., further_steps: _Optional[_Iterable[_Union[StepVerdicts, _Mapping]]] = ...) -> None: ...

class StepVerdicts(_message.Message):
    __slots__ = ("verdicts", "compute_seconds", "draft_compute_seconds")
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    compute_seconds: float
    draft_compute_seconds: float
    def __init__(self, verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ..., compute_seconds: _Optional[float] = ..., draft_compute_seconds: _Optional[float] = ...) -> None: ...
