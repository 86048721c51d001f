"""The refusals of the engine and the step code on top of it, each naming the gRPC status the
servicers answer with. Torch-free, so that the coordinator's admission and the gRPC plumbing can
raise and map them without loading torch."""

from __future__ import annotations

# The longest sequence id a service keeps (a coordinator's are 32 hex digits): ids are dict keys,
# log text, and a caller's id costs memory for as long as its sequence lives.
MAX_SEQ_ID_LENGTH = 256


class EngineError(Exception):
    """A request the engine refuses; ``code`` names the gRPC status the servicers map it to."""

    code = "INVALID_ARGUMENT"


class InvalidRequest(EngineError):
    code = "INVALID_ARGUMENT"


class UnknownSequence(EngineError):
    code = "NOT_FOUND"


class CapacityExceeded(EngineError):
    code = "RESOURCE_EXHAUSTED"


class StaleCache(EngineError):
    """The caller believes more tokens are cached than the service holds (e.g. it restarted)."""

    code = "FAILED_PRECONDITION"
