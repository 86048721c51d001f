"""gRPC clients for the draft and target services.

Every call the coordinator makes names, per sequence, the cached length to keep and the tokens to
feed (see protos/specbatch/v1/model_services.proto), so repeating a call whose reply was lost
computes the same thing: all of them are idempotent, and transient failures are retried.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import grpc
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from specbatch.protocol.sampling_params import SamplingParams
from specbatch.rpc.local import LocalChannel, LocalRpcError
from specbatch.rpc.tls import channel_options_reconnecting_within, open_channel
from specbatch.v1 import model_services_pb2 as pb
from specbatch.v1 import model_services_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# A lost connection or a restarting server: the same call will do once it is back.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE}
# The service no longer holds what we think it holds (it restarted): rebuild from history.
LOST_STATE = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}

# gRPC's own reconnect backoff grows to 120 s by default (×1.6 per failed attempt, ±20 %
# jitter), and while it waits every call on the channel fails at once. A replica back after a
# 15 s outage stayed unreachable for 7 s more, whatever the probes' own backoff (5 s cap).
# Capped at 1 s, a replica that serves again is reconnected within 1.2 s, so the next probe
# (replicas.py) finds it.
MAX_RECONNECT_BACKOFF_MS = 1000
SERVICE_CHANNEL_OPTIONS = channel_options_reconnecting_within(MAX_RECONNECT_BACKOFF_MS)


def _transient(error: BaseException) -> bool:
    return isinstance(error, grpc.RpcError) and error.code() in RETRYABLE


# The wait before the second try; it doubles before each further one, up to 1 s.
FIRST_WAIT_SECONDS = 0.05


class Retrying:
    """``retry(fn, *args)``: transient failures retried with exponential backoff, ``attempts``
    tries in all. The first try is a plain call, and tenacity takes over only after it fails: its
    bookkeeping would cost each decode step a fair part of a local call's whole round trip."""

    def __init__(self, attempts: int):
        self.rest = retry(retry=retry_if_exception(_transient), stop=stop_after_attempt(attempts - 1),
                          wait=wait_exponential(multiplier=2 * FIRST_WAIT_SECONDS, max=1.0),
                          reraise=True) if attempts > 1 else None

    def __call__(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as error:
            if self.rest is None or not _transient(error):
                raise
        time.sleep(FIRST_WAIT_SECONDS)
        return self.rest(fn)(*args, **kwargs)


def lost_state(error: BaseException) -> bool:
    return isinstance(error, grpc.RpcError) and error.code() in LOST_STATE


def unreachable(error: BaseException) -> bool:
    """The replica did not answer in time (down, restarting, or too slow): use another."""
    return isinstance(error, grpc.RpcError) and error.code() in (
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def refusal(error: BaseException) -> bool:
    """A service said no to the request itself (not a lost connection, not lost state)."""
    return (isinstance(error, grpc.RpcError) and error.code() not in RETRYABLE | LOST_STATE
            and error.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED))


@dataclass
class Call:
    """What one step asks of a service for one sequence."""

    seq_id: str
    keep_len: int
    tokens: list[int]
    features: bytes = b""  # for drafts that read target features


def _seq(call: Call) -> pb.SequenceInput:
    return pb.SequenceInput(seq_id=call.seq_id, keep_len=call.keep_len, tokens=call.tokens, features=call.features)


def _sampling_to_proto(params: SamplingParams) -> pb.Sampling:
    return pb.Sampling(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed)


@dataclass
class Traffic:
    """What a client's calls to its service weighed: serialised message bytes each way (the
    benchmark reports them per generated token)."""

    calls: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0

    def add(self, request, reply) -> None:
        self.calls += 1
        self.sent_bytes += request.ByteSize()
        self.received_bytes += reply.ByteSize()


class ServiceClient:
    """Shared by both services: channel, deadlines, retries, traffic, and the cache calls.

    Every call takes an optional ``timeout``: the time its requests have left (client deadlines
    propagate downstream), never more than the client's own ``timeout``.

    Where the service's CacheStats names a local socket that exists on this host, the calls go
    there instead of through gRPC (specbatch/rpc/local.py); a failed socket sends them back to
    gRPC (the retry that follows takes that path) until CacheStats names one again.
    """

    stub_class = None
    service_name = ""  # the proto service's full name

    def __init__(self, address: str, timeout: float, credentials: grpc.ChannelCredentials | None = None,
                 attempts: int = 4, server_name: str | None = None):
        self.address = address
        self.timeout = timeout
        self.channel = open_channel(address, credentials, SERVICE_CHANNEL_OPTIONS, server_name)
        self.stub = self.stub_class(self.channel)
        self.local: LocalChannel | None = None
        self.traffic = Traffic()
        self.retry = Retrying(attempts)
        self.answered = 0.0  # time.monotonic() of its last reply: a replica no call reaches is health-checked

    def _deadline(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else max(0.01, min(self.timeout, timeout))

    def _send(self, method: str, request, timeout: float):
        local = self.local
        if local is None:
            return getattr(self.stub, method)(request, timeout=timeout)
        try:
            return local.call(f"/{self.service_name}/{method}", request, timeout)
        except LocalRpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                log.warning("%s: %s; back to gRPC", self.address, error.details())
                self.local = None
                local.close()
            raise

    def _call(self, method: str, request, timeout: float | None = None):
        reply = self.retry(self._send, method, request, self._deadline(timeout))
        self.answered = time.monotonic()
        self.traffic.add(request, reply)
        return reply

    def prefill(self, calls: list[Call], timeout: float | None = None) -> pb.PrefillResponse:
        return self._call("Prefill", pb.PrefillRequest(sequences=[_seq(c) for c in calls]), timeout)

    def release(self, seq_ids: list[str], timeout: float | None = None) -> None:
        self.retry(self._send, "Release", pb.ReleaseRequest(seq_ids=seq_ids), self._deadline(timeout))
        self.answered = time.monotonic()

    def cache_stats(self, timeout: float | None = None) -> pb.CacheStatsResponse:
        """Always through gRPC: it says whether the service has a local socket on this host."""
        stats = self.retry(self.stub.CacheStats, pb.CacheStatsRequest(), timeout=self._deadline(timeout))
        self.answered = time.monotonic()
        path = stats.local_socket if stats.local_socket and os.path.exists(stats.local_socket) else None
        if path != (self.local.path if self.local is not None else None):
            if self.local is not None:
                self.local.close()
            self.local = LocalChannel(path) if path else None
            if path:
                log.info("%s: calls on its local socket %s", self.address, path)
        return stats

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
        self.channel.close()


class TargetClient(ServiceClient):
    stub_class = pb_grpc.TargetStub
    service_name = "specbatch.v1.Target"

    def verify(self, calls: list[Call], drafts: list[list[int]], sampling: list[SamplingParams],
               create: bool = False, return_features: bool = False,
               distributions: list | None = None, leaves: list | None = None,
               timeout: float | None = None, propose_next: list | None = None, further: list | None = None,
               further_steps: int = 0) -> pb.VerifyResponse:
        """``distributions``: per sequence, the draft's q' of each draft token (the Proposal's
        DraftDistribution messages, passed through untouched); needed where sampling is not greedy.
        ``leaves``: per sequence, the leaves to verify at each of its first drafted positions.
        ``propose_next``: per sequence, None or (k, leaves, the draft's Call) for a target that
        hosts the draft: it drafts the next step after the verdict (Verdict.proposal). ``further``:
        per sequence, None or (max_tokens, room, stop token ids) for its part in up to
        ``further_steps`` more steps in this call (FurtherSteps; VerifyResponse.further_steps)."""
        distributions = distributions or [()] * len(calls)
        leaves = leaves or [()] * len(calls)
        propose_next = propose_next or [None] * len(calls)
        further = further or [None] * len(calls)
        items = [pb.VerifyItem(sequence=_seq(c), draft_tokens=d, sampling=_sampling_to_proto(s), draft_distributions=q,
                               leaves=[pb.Leaves(tokens=tokens) for tokens in at],
                               propose_next=None if n is None else pb.ProposeNext(k=n[0], leaves=n[1],
                                                                                 draft=_seq(n[2])),
                               further=None if f is None else pb.FurtherSteps(max_tokens=f[0], room=f[1],
                                                                               stop_token_ids=f[2]))
                 for c, d, s, q, at, n, f in zip(calls, drafts, sampling, distributions, leaves, propose_next, further)]
        return self._call("Verify", pb.VerifyRequest(items=items, create=create, return_features=return_features,
                                                     further_steps=further_steps), timeout)


class DraftClient(ServiceClient):
    stub_class = pb_grpc.DraftStub
    service_name = "specbatch.v1.Draft"

    def propose(self, calls: list[Call], ks: list[int], sampling: list[SamplingParams],
                timeout: float | None = None, leaves: list[list[int]] | None = None) -> pb.ProposeResponse:
        """``leaves``: per sequence, how many leaves to propose at each of its first drafted positions."""
        leaves = leaves or [()] * len(calls)
        items = [pb.ProposeItem(sequence=_seq(c), k=k, sampling=_sampling_to_proto(s), leaves=n)
                 for c, k, s, n in zip(calls, ks, sampling, leaves)]
        return self._call("Propose", pb.ProposeRequest(items=items), timeout)
