"""gRPC plumbing shared by the three servers: construction, health, reflection, errors, shutdown."""

from __future__ import annotations

import errno
import functools
import logging
import os
import signal
import socket
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specbatch.protocol.errors import EngineError
from specbatch.rpc import reflection
from specbatch.rpc.local import LocalServer
from specbatch.rpc.logs import configure_logging  # noqa: F401  (re-exported: the servers import it from here)
from specbatch.rpc.tls import CHANNEL_OPTIONS, channel_options_reconnecting_within, open_channel

log = logging.getLogger(__name__)

# gRPC sets SO_REUSEPORT on its listeners by default, so a second server on a port in use binds
# beside the first and the kernel splits connections between them: a second coordinator, or a
# plaintext server on a TLS server's port, would serve without an error. Off, the bind fails.
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]


class PortUnavailable(RuntimeError):
    """A server's port cannot be bound: another process holds it, most often."""


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def check_port(address: str) -> None:
    """Raise ``PortUnavailable``, naming the port, if ``address`` cannot be bound now. A process
    calls it at start so that a port in use stops it before a model load or a wait for services;
    the server's own bind stays the check that counts (the port may be taken in between)."""
    host, port = _split(address)
    if port == 0:
        return
    try:
        resolved = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise PortUnavailable(f"cannot listen on {address}: {error.strerror}") from None
    for family, kind, proto, _, sockaddr in resolved:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's: TIME_WAIT is no owner
            try:
                probe.bind(sockaddr)
            except OSError as error:
                reason = "is in use" if error.errno == errno.EADDRINUSE else f"cannot be bound ({error.strerror})"
                raise PortUnavailable(f"cannot listen on {address}: port {port} {reason}") from None


def exit_if_port_in_use(program: str, argv=None) -> None:
    """Exit (code 1, one line naming the port) if ``program``'s --host and --port in ``argv`` (else
    ``sys.argv``) cannot be bound. Each program's ``__main__`` calls it before it imports torch, the
    engine or the tokenizer, which take seconds, and long before a model load or a wait for the
    services; the server's bind refuses a port taken in between (``PortUnavailable``)."""
    from specbatch.config.options import parser_for

    args, _ = parser_for(program).parse_known_args(argv)
    try:
        check_port(f"{args.host}:{args.port}")
    except PortUnavailable as error:
        raise SystemExit(str(error)) from None


def exit_stopped() -> None:
    """End a program that has stopped cleanly, skipping the interpreter's teardown: with torch,
    transformers and a model loaded it takes seconds, in which the stopped process still counts as
    running (to ``specbatch up`` waiting to stop the next one, to a supervisor), and there is
    nothing left for it to do. Logs and output are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed
            pass
    os._exit(0)

def status_of(error: EngineError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, error.code)


def engine_errors_to_status(method):
    """Map an engine's refusal to its gRPC status, with the engine's message, in a servicer method."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except EngineError as error:
            context.abort(status_of(error), str(error))

    return wrapper


class _Malformed:
    """A request whose bytes did not parse (truncated, invalid UTF-8 in a string, a wrong wire
    type): what the deserializer hands on instead of raising, so the handler can refuse it."""

    def __init__(self, error: Exception):
        self.reason = f"{type(error).__name__}: {error}"

    def refuse(self, context):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {self.reason}")


class MalformedRequests(grpc.ServerInterceptor):
    """Malformed request bytes answered INVALID_ARGUMENT. gRPC's own answer is INTERNAL
    ("Exception deserializing request!"): it reads as the server's fault, and a client retries it."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or not hasattr(handler, "_replace"):
            return handler
        parse = handler.request_deserializer

        def deserializer(data: bytes):
            try:
                return parse(data)
            except Exception as error:  # noqa: BLE001 - any parse failure is the request's
                return _Malformed(error)

        if handler.request_streaming:
            def checked_stream(behaviour):
                def run(requests, context):
                    def parsed():
                        for request in requests:
                            if isinstance(request, _Malformed):
                                request.refuse(context)
                            yield request
                    return behaviour(parsed(), context)
                return run
            wrap = checked_stream
        else:
            def checked(behaviour):
                def run(request, context):
                    if isinstance(request, _Malformed):
                        request.refuse(context)
                    return behaviour(request, context)
                return run
            wrap = checked
        kinds = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
        return handler._replace(request_deserializer=deserializer,
                                **{kind: wrap(getattr(handler, kind)) for kind in kinds if getattr(handler, kind)})


class Server:
    """A gRPC server with the standard health service and server reflection (v1 and v1alpha).

    ``stop`` flips every service to NOT_SERVING first, so load balancers and the coordinator stop
    sending work, then lets in-flight calls finish within the grace period.
    """

    def __init__(self, address: str, max_workers: int = 16, maximum_concurrent_rpcs: int | None = None,
                 credentials: grpc.ServerCredentials | None = None, interceptors=()):
        self.grpc_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
            options=SERVER_OPTIONS,
            # e.g. specbatch.service.metrics.ServiceMetrics.interceptor(); MalformedRequests last, so
            # the others see its refusals as the handler's own.
            interceptors=[*interceptors, MalformedRequests()],
            maximum_concurrent_rpcs=maximum_concurrent_rpcs,
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        self.service_names: list[str] = [health.SERVICE_NAME, *reflection.SERVICE_NAMES]
        self.servicers: list[tuple[object, str]] = []
        self.local: LocalServer | None = None  # serve_locally
        # credentials (specbatch.rpc.tls.server_credentials): TLS, or mTLS with a client CA; else plaintext.
        self.tls = credentials is not None
        try:  # a failed bind returns 0 in some gRPC versions and raises RuntimeError in others
            self.port = (self.grpc_server.add_secure_port(address, credentials) if credentials is not None
                         else self.grpc_server.add_insecure_port(address))
        except RuntimeError:
            self.port = 0
        if not self.port:
            check_port(address)  # names the reason where a probe finds it
            raise PortUnavailable(f"cannot listen on {address}: port {_split(address)[1]} is in use or cannot be bound")
        self.address = address
        self.stopped = threading.Event()

    def add(self, add_fn, servicer, service_full_name: str) -> None:
        add_fn(servicer, self.grpc_server)
        self.service_names.append(service_full_name)
        self.servicers.append((servicer, service_full_name))  # for a LocalServer beside it

    def start(self) -> "Server":
        reflection.enable_server_reflection(self.service_names, self.grpc_server)
        self.grpc_server.start()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return self

    def _set_health(self, status) -> None:
        self.health.set("", status)
        for name in self.service_names:
            self.health.set(name, status)

    def set_not_serving(self) -> None:
        """Health says NOT_SERVING (probes and clients go elsewhere) while calls still run."""
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def serve_locally(self, directory: str, kind: str, observe=None, loop=None) -> LocalServer:
        """Its servicers' calls on a Unix socket in ``directory`` too (specbatch/rpc/local.py), for
        clients on this host: named in their CacheStats, stopped with the server. ``loop``: the
        engine's ModelThread, whose thread then serves the socket's connections itself."""
        self.local = LocalServer(directory, kind, observe, loop)
        for servicer, name in self.servicers:
            self.local.add(servicer, name)
            if hasattr(servicer, "local_socket"):
                servicer.local_socket = self.local.path
        return self.local.start()

    def stop(self, grace: float = 5.0) -> None:
        if self.stopped.is_set():
            return
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.local is not None:  # its calls in flight reply; new ones find no socket and use gRPC
            self.local.stop()
        self.grpc_server.stop(grace).wait()
        self.stopped.set()

    def run_until_signal(self, grace: float = 5.0, on_stop=None) -> None:
        """Block until SIGTERM or SIGINT, then stop gracefully."""
        requested = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: requested.set())
        log.info("serving on port %d", self.port)
        while not requested.wait(0.5):
            pass
        log.info("stopping (grace %.1fs)", grace)
        if on_stop:
            on_stop()
        self.stop(grace)


# A server still starting refuses connections, and gRPC then waits before it dials again: 1 s,
# growing ×1.6 per refusal (the backoff belongs to the subchannel, which channels with the same
# options share, so a new channel per poll does not reset it). Polled while a service imports
# torch for several seconds, the next dial came up to 5 s after the server was listening. Capped
# at the poll interval, a server is seen within about 0.2 s of serving.
READINESS_CHANNEL_OPTIONS = channel_options_reconnecting_within(200)


def wait_until_serving(address: str, timeout: float, service: str = "",
                       credentials: grpc.ChannelCredentials | None = None) -> None:
    """Poll a server's health service until it answers SERVING (over TLS with ``credentials``)."""
    import time

    deadline = time.monotonic() + timeout
    with open_channel(address, credentials, READINESS_CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} is not serving after {timeout:.0f}s")
            time.sleep(0.2)
