"""What the draft and target services' servicers share: Prefill, Rollback, Release and CacheStats
over an Engine, the messages' conversions, and the leases that reclaim abandoned sequences.

The servicers are thin shells: they convert messages, hold a lock (one forward at a time on one
model) and call the engine, which runs and is tested without gRPC.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np
import torch

from specbatch.engine.batch import SequenceInput
from specbatch.engine.device import describe as describe_device
from specbatch.engine.engine import Engine
from specbatch.engine.sampling import SamplingParams, SparseDistribution
from specbatch.protocol.errors import InvalidRequest
from specbatch.protocol.speculation import FLOAT16_MAX
from specbatch.rpc.server import Server, engine_errors_to_status
from specbatch.service.metrics import ServiceMetrics
from specbatch.v1 import model_services_pb2 as pb

log = logging.getLogger(__name__)


def features_to_bytes(features: torch.Tensor | None) -> bytes:
    """Features cross the wire as float16 little-endian rows (half the bytes of float32), clamped
    to float16's range, so that a reader can refuse any that are not finite."""
    if features is None:
        return b""
    if features.dtype == torch.float16 and features.device.type == "cpu":  # a Verify's: no copy but this
        half = features.detach().clamp(-FLOAT16_MAX, FLOAT16_MAX)
    else:
        half = features.detach().to("cpu", torch.float32).clamp(-FLOAT16_MAX, FLOAT16_MAX).to(torch.float16)
    return half.contiguous().numpy().astype("<f2", copy=False).tobytes()


def features_from_bytes(seq_id: str, data: bytes, width: int) -> torch.Tensor | None:
    """The inverse of ``features_to_bytes``. Bytes that are not whole float16 values, or values
    that are not finite, are refused here; a wrong row count is left for the engine to refuse.
    Widened by torch (the CPU's own float16 conversion) and checked in float32: numpy converts
    and tests float16 in software, 8x slower, a millisecond a step for a batch of EAGLE drafts."""
    if not data or not width:
        return None
    if len(data) % 2:
        raise InvalidRequest(f"sequence {seq_id!r}: features of {len(data)} bytes are not float16 values")
    # (a copy: the message's bytes are read-only, and torch wants a buffer it may write)
    values = torch.from_numpy(np.frombuffer(data, dtype="<f2").astype(np.float16, copy=True)).float()
    if not np.isfinite(values.numpy()).all():
        raise InvalidRequest(f"sequence {seq_id!r}: features must be finite")
    if values.numel() % width:
        return values  # wrong shape: the engine says so
    return values.reshape(-1, width)


def sampling_from_proto(message: pb.Sampling) -> SamplingParams:
    return SamplingParams(message.temperature, message.top_p or 1.0, message.top_k, message.seed)


def distribution_to_proto(dist: SparseDistribution) -> pb.DraftDistribution:
    # float32 travels as float32: the target reads exactly the numbers the draft sampled with.
    return pb.DraftDistribution(token_ids=dist.token_ids.tolist(), probs=dist.probs.tolist())


def distribution_from_proto(message: pb.DraftDistribution) -> SparseDistribution:
    return SparseDistribution(np.array(message.token_ids, dtype=np.int64), np.array(message.probs, dtype=np.float32))


def sequence_inputs(engine: Engine, messages) -> list[SequenceInput]:
    """A call's sequences, checked against the engine's bounds (``Engine.check_bounds``) here, on
    the calling thread, before the call waits for the model."""
    inputs = [SequenceInput(m.seq_id, m.keep_len, list(m.tokens),
                            features_from_bytes(m.seq_id, m.features, engine.feature_size)) for m in messages]
    engine.check_bounds(inputs)
    return inputs


class CacheServicer:
    """Prefill, Rollback, Release and CacheStats: the same on the draft and the target."""

    add_to_server = None  # the generated add_…Servicer_to_server, set by each service
    service_name = ""
    local_socket = ""  # the LocalServer's path, where one serves the same calls (CacheStats names it)

    def __init__(self, engine: Engine, model_name: str, metrics: ServiceMetrics | None = None):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics  # None: no metrics (tests that drive a servicer directly)
        self.hardware = json.dumps(describe_device(engine.device), sort_keys=True)

    @classmethod
    def serve_on(cls, server: Server, engine: Engine, model_name: str,
                 metrics: ServiceMetrics | None = None) -> "CacheServicer":
        servicer = cls(engine, model_name, metrics)
        server.add(cls.add_to_server, servicer, cls.service_name)
        return servicer

    def timed(self, fn, *args, **kwargs):
        """Run an engine call through ``Engine.run``; returns (result, compute seconds)."""

        def measured():
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            return result, time.perf_counter() - start

        return self.engine.run(measured)

    def observed(self, method: str, batch_size: int, fn, *args):
        """``timed``, and the call's batch size and compute time recorded under ``method``."""
        result, seconds = self.timed(fn, *args)
        if self.metrics is not None:
            self.metrics.observe_call(method, batch_size, seconds)
        return result, seconds

    @engine_errors_to_status
    def Prefill(self, request, context):
        inputs = sequence_inputs(self.engine, request.sequences)
        lengths, _ = self.observed("Prefill", len(inputs), self.engine.prefill, inputs)
        return pb.PrefillResponse(
            sequences=[pb.SequenceLength(seq_id=i.seq_id, cached_len=n) for i, n in zip(inputs, lengths)]
        )

    @engine_errors_to_status
    def Rollback(self, request, context):
        def rollback():
            for item in request.sequences:  # check all first: a bad item changes nothing
                self.engine.check_rollback(item.seq_id, item.cached_len)
            for item in request.sequences:
                self.engine.rollback(item.seq_id, item.cached_len)

        self.timed(rollback)
        return pb.RollbackResponse()

    @engine_errors_to_status
    def Release(self, request, context):
        released, _ = self.timed(self.engine.release, list(request.seq_ids))
        return pb.ReleaseResponse(released=released)

    def CacheStats(self, request, context):
        with self.engine.lock:
            return pb.CacheStatsResponse(
                model=self.model_name,
                sequences=len(self.engine.sequences),
                cached_tokens=self.engine.cached_tokens(),
                max_sequences=self.engine.max_sequences,
                max_context=self.engine.max_context,
                vocab_size=self.engine.vocab_size,
                feature_size=self.feature_size(),
                sequences_created=self.engine.sequences_created,
                local_socket=self.local_socket,
                hardware=self.hardware,
                weights=self.engine.weights or str(self.engine.dtype).removeprefix("torch."),
            )

    def feature_size(self) -> int:
        return self.engine.feature_size


# A coordinator touches each of its sequences at every step (milliseconds to seconds apart) and
# releases them when done. One that dies, or stops with requests still running, leaves them here:
# after this long untouched they are reclaimed, so a lost coordinator costs memory for a while,
# never the sequence budget for good.
DEFAULT_SEQUENCE_LEASE_SECONDS = 300.0


class SequenceLeases:
    """Reclaims the sequences of an engine that no call touched for ``lease_seconds``: sweeps
    every quarter lease (at most every 30 s), on the engine's model thread, so a sweep never
    lands inside a forward. Each reclaim is logged and counted."""

    def __init__(self, engine: Engine, lease_seconds: float, metrics: ServiceMetrics | None = None):
        self.engine, self.lease_seconds, self.metrics = engine, lease_seconds, metrics
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sequence-leases", daemon=True)

    def sweep(self) -> list[str]:
        reclaimed = self.engine.run(self.engine.reclaim_idle, self.lease_seconds)
        if reclaimed:
            log.warning("reclaimed %d sequences untouched for over %.0f s (their coordinator is gone): %s",
                        len(reclaimed), self.lease_seconds, ", ".join(reclaimed[:8]) + (" …" if len(reclaimed) > 8 else ""))
            if self.metrics is not None:
                self.metrics.sequences_reclaimed.inc(len(reclaimed))
        return reclaimed

    def _run(self) -> None:
        interval = min(30.0, self.lease_seconds / 4)
        while not self.stopped.wait(interval):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - a failed sweep is retried at the next one
                log.exception("sequence lease sweep failed")

    def start(self) -> "SequenceLeases":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
