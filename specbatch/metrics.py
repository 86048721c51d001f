"""Prometheus metrics for the three services, named after vLLM's with a ``specbatch_`` prefix.

Every object here takes (or makes) its own ``CollectorRegistry`` and never touches
prometheus_client's global default registry: tests and ``specbatch.local`` run the coordinator,
the draft and the target in one process, and on a shared registry their metrics of the same name
would collide (or, worse, silently mix).

Callers pass plain numbers and strings, so this module knows nothing of the coordinator's or the
engine's classes beyond the few engine attributes its gauges read; docs/operations.md lists every
metric, its labels and which autoscaler reads it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector,
                               start_http_server)

from .acceptance import MAX_K, tally_positions

log = logging.getLogger(__name__)

# The HTTP port of /metrics, one per role so that all three fit on one host side by side; a
# Kubernetes pod has its own network namespace, and deploy/ uses 9090 for each. 0 turns it off.
DEFAULT_METRICS_PORTS = {"coordinator": 9090, "target": 9091, "draft": 9092}

# Buckets. Latencies follow vLLM's so that dashboards made for vLLM read these too; batch sizes
# double up to the services' default --max-sequences (256) and beyond.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                 300.0, 600.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
K_BUCKETS = tuple(range(MAX_K + 1))  # one bucket per k: the histogram is a plain count by k


@dataclass
class MetricsServer:
    """The /metrics HTTP server started by ``start_metrics_server``."""

    port: int
    _httpd: object
    _thread: threading.Thread

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve ``registry`` as Prometheus text on http://HOST:PORT/metrics (any path, in fact) from a
    daemon thread. ``port`` 0 picks a free port; the returned object's ``.port`` says which."""
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(httpd.server_address[1], httpd, thread)


def new_registry() -> CollectorRegistry:
    """A registry of one's own, with the process's memory, CPU and open files in it
    (``process_*``; Linux only), as the default registry would have had."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


class CoordinatorMetrics:
    """What the coordinator exports: load, the speculation itself, request latencies and outcomes,
    step timing, and the health of the replicas it talks to.

    Methods take plain numbers; the scheduler calls ``observe_step`` once per decode step,
    ``observe_finished``/``observe_failed`` once per request that ends, and ``observe_rejected``
    for one refused at admission (so a refused request is counted once, never also as failed).
    """

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else new_registry()
        r = self.registry

        # ---- load (read when scraped, from the scheduler: see track_load) ----
        self.running = Gauge("specbatch_num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("specbatch_num_requests_waiting",
                             "Requests admitted and waiting for a batch slot (the coordinator HPA's metric).",
                             registry=r)
        self.occupancy = Gauge("specbatch_batch_occupancy", "Running requests / the maximum batch size, 0..1.",
                               registry=r)

        # ---- speculation ----
        self.batch_size = Histogram("specbatch_batch_size", "Sequences in a decode step.", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.k = Histogram("specbatch_spec_decode_k", "k (draft tokens asked for) per sequence per step; 0 is a "
                           "target-only step for that sequence.", buckets=K_BUCKETS, registry=r)
        self.num_drafts = Counter("specbatch_spec_decode_num_drafts",
                                  "Drafts proposed and verified (one per sequence per step with k > 0).", registry=r)
        self.num_draft_tokens = Counter("specbatch_spec_decode_num_draft_tokens", "Draft tokens verified.",
                                        registry=r)
        self.num_accepted_tokens = Counter("specbatch_spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted by the target.", registry=r)
        self.accepted_per_pos = Counter("specbatch_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0-based).", ["position"],
                                        registry=r)
        # vLLM divides accepted_per_pos by num_drafts; that mixes in drafts that never reached the
        # position (a shorter k, or an earlier rejection). Counting the drafts that reached each
        # position gives the conditional acceptance, which is what a k policy needs.
        self.reached_per_pos = Counter("specbatch_spec_decode_num_draft_tokens_per_pos",
                                       "Drafts that reached each draft position (drafted that far with every earlier "
                                       "position accepted); acceptance at i = accepted_per_pos[i] / this[i].",
                                       ["position"], registry=r)

        # ---- requests ----
        self.ttft = Histogram("specbatch_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("specbatch_time_per_output_token_seconds",
                              "Mean time per generated token after the first, per request.", buckets=TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("specbatch_e2e_request_latency_seconds", "Arrival to the request's end.",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("specbatch_request_queue_time_seconds", "Arrival to joining the running batch.",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.success = Counter("specbatch_request_success", "Requests that finished, by finish reason.",
                               ["finished_reason"], registry=r)
        self.failure = Counter("specbatch_request_failure", "Admitted requests that ended with an error status.",
                               ["code"], registry=r)
        self.rejected = Counter("specbatch_requests_rejected", "Requests refused at admission, by status code.",
                                ["code"], registry=r)
        self.prompt_tokens = Counter("specbatch_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("specbatch_generation_tokens", "Tokens generated for finished requests.",
                                         registry=r)

        # ---- steps and replicas ----
        self.step_seconds = Histogram("specbatch_step_seconds",
                                      "Decode step time by phase: draft (Propose calls), target (Verify calls), "
                                      "coordinator (the rest of the step).", ["phase"], buckets=STEP_BUCKETS,
                                      registry=r)
        self.replica_up = Gauge("specbatch_replica_up", "1 while the coordinator counts a replica healthy, else 0.",
                                ["service", "address"], registry=r)
        self.failovers = Counter("specbatch_replica_failovers", "Sequences moved off a failed replica.", ["service"],
                                 registry=r)
        self.draft_fallback = Counter("specbatch_draft_fallback_steps",
                                      "Steps run target-only because no draft replica was healthy.", registry=r)
        self.policy = Info("specbatch_k_policy", "The k policy in force.", registry=r)

    def track_load(self, load_fn, max_batch_size: int) -> None:
        """Read the load from ``load_fn() -> (running, waiting)`` whenever /metrics is scraped.

        Read at scrape time rather than pushed on every change, so the gauges are never stale and
        the scheduler does nothing per request for them. ``load_fn`` must be cheap and must not
        block on the step loop (the scheduler's ``load`` takes two ``len``s)."""
        self.running.set_function(lambda: load_fn()[0])
        self.waiting.set_function(lambda: load_fn()[1])
        self.occupancy.set_function(lambda: load_fn()[0] / max_batch_size if max_batch_size else 0.0)

    def observe_step(self, batch_size: int, ks: list[int], outcomes: list[tuple[int, int]],
                     draft_seconds: float, target_seconds: float, step_seconds: float) -> None:
        """One decode step.

        ``ks``: the k chosen for each sequence of the batch (0 where it ran target-only).
        ``outcomes``: (drafted, accepted) for each sequence that drafted (drafted > 0); drafted may
        be below its k where the draft stopped early. Times are wall seconds of the step's Propose
        calls, its Verify calls, and the whole step; the coordinator's own share is the rest.
        """
        self.batch_size.observe(batch_size)
        for k in ks:
            self.k.observe(k)
        drafts = [(d, a) for d, a in outcomes if d > 0]
        self.num_drafts.inc(len(drafts))
        self.num_draft_tokens.inc(sum(d for d, _ in drafts))
        self.num_accepted_tokens.inc(sum(a for _, a in drafts))
        reached, accepted = tally_positions(drafts, MAX_K)
        for i, (n_reached, n_accepted) in enumerate(zip(reached, accepted)):
            if n_reached:  # no series for positions never drafted: k=3 shows three, not sixteen
                self.reached_per_pos.labels(position=str(i)).inc(n_reached)
                self.accepted_per_pos.labels(position=str(i)).inc(n_accepted)
        self.step_seconds.labels(phase="draft").observe(draft_seconds)
        self.step_seconds.labels(phase="target").observe(target_seconds)
        # Clamped: the phases are timed separately, and rounding must not make a negative sample.
        self.step_seconds.labels(phase="coordinator").observe(max(0.0, step_seconds - draft_seconds - target_seconds))

    def observe_finished(self, finished_reason: str, queue_seconds: float, first_token_seconds: float | None,
                         total_seconds: float, prompt_tokens: int, generated_tokens: int) -> None:
        """A request that ended normally (stop, length, eos …; a cancelled stream too).

        All times are from the request's arrival. ``first_token_seconds`` is None when no token was
        generated; time per output token is then undefined and, as with one token, not observed."""
        self.success.labels(finished_reason=finished_reason).inc()
        self.queue_time.observe(queue_seconds)
        self.e2e.observe(total_seconds)
        if first_token_seconds is not None:
            self.ttft.observe(first_token_seconds)
            if generated_tokens > 1:
                self.tpot.observe((total_seconds - first_token_seconds) / (generated_tokens - 1))
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)

    def observe_failed(self, code: str) -> None:
        """An admitted request that ended with an error status (``code``: a grpc.StatusCode name)."""
        self.failure.labels(code=code).inc()

    def observe_rejected(self, code: str) -> None:
        """A request refused at admission: INVALID_ARGUMENT, RESOURCE_EXHAUSTED (queue full) …"""
        self.rejected.labels(code=code).inc()

    def set_replica_up(self, service: str, address: str, up: bool) -> None:
        self.replica_up.labels(service=service, address=address).set(1 if up else 0)

    def forget_replica(self, service: str, address: str) -> None:
        """Drop a replica's series once it is gone for good (left DNS), so it does not read 0 forever."""
        try:
            self.replica_up.remove(service, address)
        except KeyError:
            pass

    def count_failover(self, service: str, n: int) -> None:
        """``n`` sequences moved off a failed ``service`` ("draft" or "target") replica."""
        if n:
            self.failovers.labels(service=service).inc(n)

    def count_draft_fallback(self) -> None:
        self.draft_fallback.inc()

    def set_policy(self, description: str) -> None:
        """The k policy in force, as text (e.g. "fixed:3", "goodput (profile …)")."""
        self.policy.info({"policy": description})


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

    def observe_call(self, method: str, batch_size: int, compute_seconds: float) -> None:
        """One engine call of a Prefill, Propose or Verify that succeeded."""
        self.batch_size.labels(method=method).observe(batch_size)
        self.compute_seconds.labels(method=method).observe(compute_seconds)

    def observe_request(self, method: str, code: str, seconds: float) -> None:
        self.requests.labels(method=method, code=code).inc()
        self.request_seconds.labels(method=method).observe(seconds)

    def interceptor(self) -> grpc.ServerInterceptor:
        """A server interceptor recording every unary RPC into ``observe_request``; pass it to
        ``specbatch.serving.Server(interceptors=[...])``."""
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


def serve_metrics(registry, kind: str, host: str, port: int | None):
    """Serve /metrics; None if turned off (port 0) or, for the default port only, if it is taken.

    A port given on the command line must work: failing at start is what an operator wants. The
    default port may be taken by a second stack on the same host (``specbatch up`` twice, the test
    suite beside a demo); that stack still serves, without metrics, and says so.
    """
    chosen = DEFAULT_METRICS_PORTS[kind] if port is None else port
    if not chosen:
        return None
    try:
        server = start_metrics_server(registry, host, chosen)
    except OSError as error:
        if port is not None:
            raise SystemExit(f"cannot serve /metrics on {host}:{chosen}: {error}") from error
        log.warning("%s: no /metrics: default port %s:%d unavailable (%s); pass --metrics-port",
                    kind, host, chosen, error)
        return None
    log.info("%s: metrics on http://%s:%d/metrics", kind, host, server.port)
    return server
