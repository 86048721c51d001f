"""One client request inside the coordinator: its authoritative token history, how much of it
each service has cached, its text stream and its stats."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from specbatch.protocol.sampling_params import SamplingParams
from specbatch.v1 import generation_pb2 as pb

from .lookup import PromptLookup

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # an older tokenizers: two decodes a token through the wrapper
    DecodeStream = None

FINISH_LENGTH = pb.FINISH_REASON_LENGTH
FINISH_STOP = pb.FINISH_REASON_STOP
FINISH_EOS = pb.FINISH_REASON_EOS
FINISH_CANCELLED = pb.FINISH_REASON_CANCELLED


class TextStream:
    """Turns generated token ids into text deltas.

    Decoding is incremental (a window of the last few tokens, as in vLLM and TGI), so a step
    costs the same at token 1000 as at token 1. Text that a stop string could still claim is
    held back, as are incomplete UTF-8 sequences (decoded as U+FFFD until their last byte comes).
    """

    def __init__(self, tokenizer, stop_strings: list[str]):
        self.tokenizer = tokenizer
        # A fast tokenizer's own incremental decoder (the same window, in Rust): several times
        # cheaper a token than two decodes through the Python wrapper, where a large batch makes
        # this the coordinator's main per-token cost. Not where the wrapper would clean up spaces
        # after decoding, which the decoder does not.
        self.backend = getattr(tokenizer, "_tokenizer", None)
        self.decoder = None
        if self.backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False) \
                and DecodeStream is not None:
            self.decoder = DecodeStream(skip_special_tokens=True)
        self.stop_strings = stop_strings
        self.holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.prefix_offset = 0  # the window's first token: context for the tokens after it
        self.read_offset = 0  # tokens before this are already in self.text

    def _unread(self) -> str:
        """Text of the tokens after read_offset, decoded with the window's tokens as context."""
        known = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        return self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=True)[len(known) :]

    def add(self, token: int) -> bool:
        """Append a token; True when the text now contains a stop string (the text is cut before it)."""
        self.ids.append(token)
        if self.decoder is not None:
            new = self.decoder.step(self.backend, token) or ""  # None: an incomplete character
        else:
            new = self._unread()
        if new and not new.endswith("\ufffd"):
            self.text += new
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if not self.stop_strings:
            return False
        start = max(0, self.sent - self.holdback - 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop_strings) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def finish(self) -> None:
        """Flush what the window still holds back (a last incomplete character, say)."""
        self.text += self._unread()
        self.read_offset = len(self.ids)

    def delta(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            end -= self.holdback
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out


@dataclass(frozen=True)
class Failure:
    """Ends a client's stream with an error status instead of a finish reason."""

    code: object  # grpc.StatusCode
    message: str
    retry: bool = False  # the client may retry later: the status carries a retry-after-ms hint


class FeatureLog:
    """The target's final hidden state at each cached position of one sequence (float16 bytes, as
    the target sent them), kept for a draft that reads them: the draft's input at position j is
    the feature at j-1. Kept here, beside the history, so that a restarted draft is rebuilt
    from the coordinator alone."""

    def __init__(self, row_bytes: int):
        self.row_bytes = row_bytes
        self.data = bytearray()

    @property
    def rows(self) -> int:
        return len(self.data) // self.row_bytes if self.row_bytes else 0

    def store(self, start: int, rows: bytes) -> None:
        """The target fed (and kept) positions ``start …``: their features replace what was there."""
        del self.data[start * self.row_bytes :]
        self.data += rows

    def for_tokens(self, start: int, end: int) -> bytes:
        """What a draft reads with tokens ``start … end-1``: features ``start-1 … end-2`` (zeros
        before position 0)."""
        first = b"\0" * self.row_bytes if start == 0 else b""
        return first + bytes(self.data[max(start - 1, 0) * self.row_bytes : (end - 1) * self.row_bytes])


def log_fields(request: "Request") -> dict:
    """The ``extra`` of a log record about one request (structured logs carry both its names)."""
    return {"extra": {"request_id": request.id, "seq_id": request.seq_id}}


@dataclass
class Request:
    id: str  # the client's name for it (or one made up), echoed in every response
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    text: TextStream
    fixed_k: int | None = None
    fixed_leaves: int | None = None  # its own leaves beside the first draft (else the coordinator's --leaves)
    prompt_lookup: int | None = None  # its own --prompt-lookup (else the coordinator's)
    shared_lookup: bool = True  # False: kept out of the coordinator's shared lookup index
    # Tokens its stream sends at once after the first (--stream-interval, or the request's own; 0:
    # the whole output at its end only): each message wakes the server's and the client's threads,
    # on cores the model services compute on.
    stream_interval: int = 1
    arrival: float = field(default_factory=time.monotonic)
    # The services' key for its caches: always unique, whatever request_id clients send.
    seq_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Authoritative history: prompt + every accepted token. Services only cache prefixes of it.
    history: list[int] = field(default_factory=list)
    target_len: int = 0  # tokens of history cached on its target replica
    # Its prompt was refused for want of room on a target that held nothing else: once may be a
    # race with another coordinator's release, twice means it does not fit even alone.
    refused_alone: int = 0
    draft_len: int = 0  # tokens of history cached on its draft replica
    # The draft's proposal for the next step, made inside the last Verify by a draft hosted in the
    # target's process (specbatch.v1.Proposal), valid while the history is ``ahead_at`` tokens long.
    ahead: object | None = None
    ahead_at: int = 0
    # Drafts kept per chain, a moving average for each source (coordinator/proposers.py,
    # ``kept``): where both prompt lookup and a proposal made ahead offer a chain, the one
    # that has kept more for this request is verified.
    kept: dict = field(default_factory=dict)
    # Prompt lookup's index of this request's history (coordinator/lookup.py), made on first use.
    lookup: PromptLookup | None = None
    # The replicas its caches live on (replicas.Replica), for its life unless one fails.
    target_replica: object | None = None
    draft_replica: object | None = None
    deadline: float | None = None  # time.monotonic() by which the client wants it done
    features: FeatureLog | None = None  # only for drafts that read target features
    # stats
    admitted: float | None = None
    first_token: float | None = None
    steps: int = 0
    sent: int = 0  # tokens streamed so far (the rest of the history past the prompt waits)
    proposed: int = 0
    accepted: int = 0
    finish: int | None = None
    failure: Failure | None = None  # set when it ended with an error status instead
    events: "queue.Queue[pb.GenerateResponse | Failure]" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.history = list(self.prompt)

    @property
    def generated(self) -> int:
        return len(self.history) - len(self.prompt)

    def cancel(self) -> None:
        self.cancelled.set()

    def finish_name(self) -> str:
        return pb.FinishReason.Name(self.finish).removeprefix("FINISH_REASON_").lower()

    def time_left(self, now: float) -> float | None:
        return None if self.deadline is None else self.deadline - now

    def take(self, tokens: list[int]) -> None:
        """Append accepted tokens one by one until a finish condition; stream what was taken."""
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        for token in tokens:
            self.history.append(token)
            if token in self.stop_token_ids:
                self.finish = FINISH_EOS
            elif self.text.add(token):
                self.finish = FINISH_STOP
            elif self.generated >= self.max_new_tokens:
                self.finish = FINISH_LENGTH
            if self.finish is not None:
                break
        # The first tokens go out at once, then at least stream_interval at a time, and all at a
        # finish (only then, at an interval of 0); close() then flushes what the text stream still
        # holds and sends it last.
        if self.finish is not None:
            if self.stream_interval:
                self.events.put(self._unsent(True))
            self.close(self.finish)
        elif self.stream_interval and (not self.sent or self.generated - self.sent >= self.stream_interval):
            self.events.put(self._unsent(False))

    def _unsent(self, final: bool, **fields) -> pb.GenerateResponse:
        """A response with the tokens and text not streamed yet (``final``: the text stream's rest
        too), and ``fields``."""
        tokens = self.history[len(self.prompt) + self.sent:]
        self.sent = self.generated
        return pb.GenerateResponse(request_id=self.id, token_ids=tokens, text=self.text.delta(final), **fields)

    def fail(self, code, message: str, retry: bool = False) -> None:
        """End the request with an error status (a service refused it); it is retired next.
        ``retry``: the refusal may not hold later (room taken by others), and says when to retry."""
        self.finish = FINISH_CANCELLED
        self.failure = Failure(code, message, retry)
        if self.generated > self.sent:  # what was accepted before the refusal still reaches the client
            self.events.put(self._unsent(False))
        self.events.put(self.failure)

    def close(self, reason: int) -> None:
        """Send the last response: the finish reason and the request's stats."""
        self.finish = reason
        if reason != FINISH_STOP:
            self.text.finish()
        now = time.monotonic()
        stats = pb.RequestStats(
            prompt_tokens=len(self.prompt),
            generated_tokens=self.generated,
            draft_tokens_proposed=self.proposed,
            draft_tokens_accepted=self.accepted,
            steps=self.steps,
            queue_seconds=(self.admitted or now) - self.arrival,
            first_token_seconds=(self.first_token or now) - self.arrival,
            total_seconds=now - self.arrival,
        )
        self.events.put(self._unsent(True, finish_reason=reason, stats=stats))
