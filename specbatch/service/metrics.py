"""The draft and target services' Prometheus metrics: the engine's load, per-method batch sizes
and compute times, and every unary RPC's outcome and latency (docs/operations.md)."""

from __future__ import annotations

import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from specbatch.rpc.metrics import BATCH_BUCKETS, STEP_BUCKETS, new_registry


class ServiceMetrics:
    """What a draft or target service exports: its engine's load, per-method batch sizes and
    compute times, and every unary RPC's outcome and latency (through ``interceptor()``).

    The engine gauges are read when /metrics is scraped, without the engine's lock: a scrape must
    never wait behind a forward that takes seconds, and a value one call old is fine for an
    autoscaler. They are therefore approximate while a call is changing the engine.
    """

    def __init__(self, kind: str, engine, registry: CollectorRegistry | None = None):
        self.kind = kind
        self.registry = registry if registry is not None else new_registry()
        r = self.registry
        Info("specbatch_service", "Which service this is.", registry=r).info({"service": kind})

        def sequences() -> list:
            # list() copies the dict's values in one C call, under the GIL, so a concurrent insert
            # or release cannot break the iteration (Engine.cached_tokens() iterates in Python).
            return list(engine.sequences.values())

        Gauge("specbatch_num_sequences", "Sequences with a KV cache in this service.",
              registry=r).set_function(lambda: len(engine.sequences))
        Gauge("specbatch_cached_tokens", "Tokens held in this service's KV caches.",
              registry=r).set_function(lambda: sum(cache.length for cache in sequences()))
        Gauge("specbatch_max_sequences", "Sequences this service may cache at once (--max-sequences).",
              registry=r).set_function(lambda: engine.max_sequences)
        Gauge("specbatch_batch_occupancy", "Sequences cached / --max-sequences, 0..1 (the target and draft HPAs' "
              "metric).", registry=r).set_function(lambda: len(engine.sequences) / max(1, engine.max_sequences))

        captured = getattr(engine, "forward", None)
        if hasattr(captured, "eager_reasons"):  # captured steps (specbatch.engine.captured): what fell back, and why
            calls = Gauge("specbatch_captured_calls", "Forward calls of the captured steps, by path: replayed (a "
                          "bucket's graph), or eager (fits no bucket; the reason is logged the first time).",
                          ["path"], registry=r)
            calls.labels(path="replayed").set_function(lambda: captured.replayed)
            calls.labels(path="eager").set_function(lambda: captured.eager)
        self.batch_size = Histogram("specbatch_service_batch_size", "Sequences in one Prefill, Propose or Verify call.",
                                    ["method"], buckets=BATCH_BUCKETS, registry=r)
        self.compute_seconds = Histogram("specbatch_service_compute_seconds",
                                         "Engine time of one call, lock wait and gRPC excluded.", ["method"],
                                         buckets=STEP_BUCKETS, registry=r)
        self.requests = Counter("specbatch_service_requests", "Unary RPCs served, by method and status code.",
                                ["method", "code"], registry=r)
        self.request_seconds = Histogram("specbatch_service_request_seconds",
                                         "Unary RPC time in the server: handler start to reply, lock wait included.",
                                         ["method"], buckets=STEP_BUCKETS, registry=r)
        self.sequences_reclaimed = Counter(
            "specbatch_sequences_reclaimed", "Sequences released because no call touched them for "
            "--sequence-lease-seconds (their coordinator stopped or died without releasing them).", registry=r)

    def report_emulated_acceptance(self, rates: tuple[float, ...]) -> None:
        """A target under --emulate-acceptance: its rates, one series per position given (later
        positions repeat the last). Off, the metric has no series."""
        gauge = Gauge("specbatch_emulated_acceptance", "The conditional acceptance rate per draft position this "
                      "target emulates (--emulate-acceptance: drafts kept by seeded draws, not verified; output is "
                      "not the target's, for timing only); the last position's rate repeats. Absent: off.",
                      ["position"], registry=self.registry)
        for position, rate in enumerate(rates):
            gauge.labels(position=str(position)).set(rate)

    def observe_call(self, method: str, batch_size: int, compute_seconds: float) -> None:
        """One engine call of a Prefill, Propose or Verify that succeeded."""
        self.batch_size.labels(method=method).observe(batch_size)
        self.compute_seconds.labels(method=method).observe(compute_seconds)

    def observe_request(self, method: str, code: str, seconds: float) -> None:
        self.requests.labels(method=method, code=code).inc()
        self.request_seconds.labels(method=method).observe(seconds)

    def interceptor(self) -> grpc.ServerInterceptor:
        """A server interceptor recording every unary RPC into ``observe_request``; pass it to
        ``specbatch.rpc.server.Server(interceptors=[...])``."""
        return _RequestMetricsInterceptor(self)


class _RequestMetricsInterceptor(grpc.ServerInterceptor):
    """Counts and times unary-unary RPCs (every model-service method, and health Check).

    Streaming RPCs (health Watch, reflection) pass through untouched: they are long-lived or
    tooling, and a per-call latency means little for them.
    """

    def __init__(self, metrics: ServiceMetrics):
        self.metrics = metrics

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]  # "/specbatch.v1.Target/Verify" -> "Verify"
        inner = handler.unary_unary
        metrics = self.metrics

        def measured(request, context):
            start = time.perf_counter()
            try:
                reply = inner(request, context)
            except Exception:
                # context.abort() raises after setting the code; any other exception becomes UNKNOWN.
                metrics.observe_request(method, _code_name(context.code(), grpc.StatusCode.UNKNOWN),
                                        time.perf_counter() - start)
                raise
            metrics.observe_request(method, _code_name(context.code(), grpc.StatusCode.OK), time.perf_counter() - start)
            return reply

        return grpc.unary_unary_rpc_method_handler(measured, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def _code_name(code, default: grpc.StatusCode) -> str:
    """The status a call ended with: what the handler set on its context, else ``default``.

    ``context.code()`` is a grpc.StatusCode when set through the API; it may also be a plain int
    when a handler set one directly, hence the lookup by value."""
    if code is None:
        return default.name
    if isinstance(code, grpc.StatusCode):
        return code.name
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status.name
    return default.name
