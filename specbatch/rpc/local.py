"""The model services' calls over a Unix socket: a fast path for a coordinator on the same host.

The same protobuf messages, servicer methods and status codes as gRPC; only the transport
differs. Why: a service idles between its calls while the other service computes, and gRPC's
Python server hands each call across threads that were asleep, so an empty call after such a gap
takes far longer to reach its handler and come back than over a Unix socket read by a thread
waiting on it: in the services, the engine's model thread itself (``LocalServer(loop=…)``), so a
call runs where it arrives (docs/decisions/local-sockets.md). A speculative step makes two such
calls (one, where the target hosts the draft).

A service started with ``--local-socket-dir DIR`` listens on a socket of its own in DIR (named
with a fresh id, so a restarted service's socket is a new path and a coordinator elsewhere never
finds one by accident) and reports the path in CacheStats. A client that reads a path there
which exists on its own host sends its calls that way (``ServiceClient``); where the socket
fails it goes back to gRPC for good, until CacheStats names a socket again. gRPC stays the
contract: health, reflection, TLS, and every client off the host.

Frames: a request is ``<IHd`` (body bytes, method name bytes, seconds it has left) then the
method's full name ("/specbatch.v1.Target/Verify") and the serialised request; a reply is ``<IB``
(body bytes, status: 0 OK, else the grpc.StatusCode's number) then the serialised reply, or the
status's details in UTF-8.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import struct
import threading
import time
import uuid
from pathlib import Path

import grpc
from google.protobuf import descriptor_pool, message_factory

from specbatch.rpc.tls import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

# The folder ``specbatch up`` makes for its services' sockets (in the temporary folder). A service
# that stops removes its socket and, where the folder is such a stack's own and now empty, the
# folder: so it goes with the last service even when the launcher was killed (its services are
# sent SIGTERM then). A folder an operator named is theirs, and stays.
STACK_SOCKET_DIR_PREFIX = "specbatch-sockets-"

REQUEST = struct.Struct("<IHd")
# The most connections served at once. A coordinator holds one per thread calling at a time;
# past this a new connection is closed at once, and its client goes back to gRPC.
MAX_CONNECTIONS = 64
# Served on a loop's thread (``LocalServer(loop=…)``): how long a frame's rest may take to arrive,
# and its reply to leave, before the connection is dropped.
FRAME_SECONDS = 10.0
REPLY = struct.Struct("<IB")
CODES = {code.value[0]: code for code in grpc.StatusCode}


@functools.lru_cache(maxsize=None)
def _method(full_name: str):
    """(request class, reply class) of "/package.Service/Method"."""
    service, _, name = full_name.strip("/").rpartition("/")
    method = descriptor_pool.Default().FindServiceByName(service).methods_by_name[name]
    return message_factory.GetMessageClass(method.input_type), message_factory.GetMessageClass(method.output_type)


def _read(conn: socket.socket, size: int) -> bytes | None:
    """Exactly ``size`` bytes, or None where the peer closed first."""
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _skip(conn: socket.socket, size: int) -> bool:
    """Read and drop ``size`` bytes; False where the peer closed first."""
    while size > 0:
        chunk = conn.recv(min(size, 1 << 20))
        if not chunk:
            return False
        size -= len(chunk)
    return True


class LocalRpcError(grpc.RpcError):
    """A failed local call, read as the coordinator reads a failed gRPC call."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Aborted(Exception):
    pass


class LocalContext:
    """What the servicers use of a gRPC ServicerContext: ``abort``, and the deadline."""

    def __init__(self, seconds_left: float):
        self.deadline = time.monotonic() + seconds_left
        self.code, self.message = grpc.StatusCode.OK, ""

    def abort(self, code: grpc.StatusCode, details: str):
        self.code, self.message = code, details
        raise _Aborted

    def time_remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


class LocalServer:
    """Serves servicers' methods on a Unix socket in ``directory``, at most ``MAX_CONNECTIONS``
    connections: each on a thread of its own, or, given a ``loop`` (the engine's ModelThread), all
    on the loop's thread, so that a call runs where its forward runs, with no hand-over between
    threads. ``observe(method, code name, seconds)`` ("Verify", "OK", …): each call, as the gRPC
    server's metrics interceptor sees its own."""

    def __init__(self, directory: str | Path, kind: str, observe=None, loop=None):
        self.path = str(Path(directory) / f"specbatch-{kind}-{uuid.uuid4().hex[:12]}.sock")
        self.observe = observe
        self.loop = loop  # where given (an engine's ModelThread): its thread serves every connection
        self.handlers: dict[str, tuple] = {}  # full method name -> (bound method, request class)
        self.listener: socket.socket | None = None
        self.idle: set[socket.socket] = set()  # connections waiting for their next call
        self.lock = threading.Lock()
        self.connections = threading.BoundedSemaphore(MAX_CONNECTIONS)  # one a connection's thread

    def add(self, servicer, service_full_name: str) -> None:
        service = descriptor_pool.Default().FindServiceByName(service_full_name)
        for method in service.methods:
            if method.client_streaming or method.server_streaming or not hasattr(servicer, method.name):
                continue
            name = f"/{service_full_name}/{method.name}"
            self.handlers[name] = (getattr(servicer, method.name), _method(name)[0])

    def start(self) -> "LocalServer":
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is its owner's alone: it skips TLS
        try:
            listener.bind(self.path)
        finally:
            os.umask(old_umask)
        listener.listen()
        self.listener = listener
        threading.Thread(target=self._accept, name="local-rpc", daemon=True).start()
        log.info("local calls on %s", self.path)
        return self

    def stop(self) -> None:
        """No new connections or calls: the idle connections are closed at once (their clients go
        back to gRPC), a call in flight sends its reply first, as gRPC's graceful stop lets it."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            path = Path(self.path)
            path.unlink(missing_ok=True)
            if path.parent.name.startswith(STACK_SOCKET_DIR_PREFIX):
                try:
                    path.parent.rmdir()
                except OSError:  # another service's socket is still there (it removes the folder), or it is gone
                    pass
        with self.lock:
            for conn in self.idle:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already gone

    def _accept(self) -> None:
        while (listener := self.listener) is not None:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # stopped
            if not self.connections.acquire(blocking=False):
                conn.close()
                continue
            if self.loop is None:
                threading.Thread(target=self._serve, args=(conn,), name="local-rpc-call", daemon=True).start()
                continue
            # A frame's rest is read, and its reply sent, on the loop's thread: a peer that stalls
            # mid-frame holds it this long at most, then loses its connection.
            conn.settimeout(FRAME_SECONDS)
            with self.lock:
                self.idle.add(conn)
            self.loop.watch(conn, functools.partial(self._serve_watched, conn))

    def _serve(self, conn: socket.socket) -> None:
        """A connection's calls on a thread of its own, until it closes."""
        try:
            while self._serve_one(conn):
                pass
        finally:
            self._closed(conn)

    def _serve_watched(self, conn: socket.socket) -> None:
        """One call of a connection the loop watches (it is readable)."""
        with self.lock:
            self.idle.discard(conn)
        try:
            served = self._serve_one(conn, waiting=False)
        except Exception:  # noqa: BLE001 - a bug here ends this connection, never the model thread
            log.exception("local connection failed")
            served = False
        if served:
            with self.lock:
                if self.listener is not None:  # else stop has shut the idle ones: this one closes here
                    self.idle.add(conn)
                    return
        self.loop.unwatch(conn)
        self._closed(conn)

    def _closed(self, conn: socket.socket) -> None:
        with self.lock:
            self.idle.discard(conn)
        conn.close()
        self.connections.release()

    def _serve_one(self, conn: socket.socket, waiting: bool = True) -> bool:
        """Read one request from ``conn``, answer it; False where the connection ended (closed,
        failed, or the server stopped). ``waiting``: the connection is idle until its request
        comes (stop may shut it meanwhile)."""
        try:
            if waiting:
                with self.lock:  # (stop shuts what is idle under the same lock)
                    if self.listener is None:
                        return False  # stopped
                    self.idle.add(conn)
            head = _read(conn, REQUEST.size)
            if waiting:
                with self.lock:
                    self.idle.discard(conn)
            if head is None:
                return False
            size, name_size, seconds_left = REQUEST.unpack(head)
            if size > MAX_MESSAGE_BYTES:  # gRPC's cap too: the frame is read past, never held
                if not _skip(conn, name_size + size):
                    return False
                refusal = f"a request of {size} bytes: the cap is {MAX_MESSAGE_BYTES}".encode()
                conn.sendall(REPLY.pack(len(refusal), grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]) + refusal)
                return True
            name, body = _read(conn, name_size), _read(conn, size)
            if name is None or body is None:
                return False
            # (a name that is not UTF-8 names no method: UNIMPLEMENTED, as gRPC answers it)
            status, reply = self._call(name.decode(errors="replace"), body, seconds_left)
            conn.sendall(REPLY.pack(len(reply), status) + reply)
            return True
        except OSError:
            return False  # the client went away, or the server stopped

    def _call(self, name: str, body: bytes, seconds_left: float) -> tuple[int, bytes]:
        started = time.perf_counter()
        status, reply = self._handle(name, body, seconds_left if math.isfinite(seconds_left) else 0.0)
        if self.observe is not None:
            self.observe(name.rsplit("/", 1)[-1], CODES.get(status, grpc.StatusCode.UNKNOWN).name,
                         time.perf_counter() - started)
        return status, reply

    def _handle(self, name: str, body: bytes, seconds_left: float) -> tuple[int, bytes]:
        context = LocalContext(seconds_left)
        try:
            handler, request_class = self.handlers[name]
        except KeyError:  # gRPC's answer to a method it does not serve
            context.code, context.message = grpc.StatusCode.UNIMPLEMENTED, f"no method {name!r}"
            return context.code.value[0], context.message.encode()
        try:
            request = request_class.FromString(body)
        except Exception as error:  # noqa: BLE001 - as gRPC's MalformedRequests (specbatch.rpc.server)
            context.code, context.message = grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {error}"
            return context.code.value[0], context.message.encode()
        try:
            reply = handler(request, context)
        except _Aborted:
            pass
        except Exception as error:  # as gRPC's server: the call fails, the service goes on
            log.exception("local call %s failed", name)
            context.code, context.message = grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}"
        else:
            if context.code == grpc.StatusCode.OK:
                return 0, reply.SerializeToString()
        return context.code.value[0], context.message.encode()


class LocalChannel:
    """A client's calls to one LocalServer: a connection per caller at a time (the coordinator
    calls a service from several threads), each reused."""

    def __init__(self, path: str):
        self.path = path
        self.idle: list[socket.socket] = []
        self.lock = threading.Lock()

    def call(self, full_name: str, request, timeout: float):
        """The reply to ``request``; a failure raises LocalRpcError (UNAVAILABLE where the socket
        failed: nothing reached the service, or its reply was lost)."""
        with self.lock:
            conn = self.idle.pop() if self.idle else None
        try:
            if conn is None:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.connect(self.path)
            conn.settimeout(timeout)
            body, name = request.SerializeToString(), full_name.encode()
            conn.sendall(REQUEST.pack(len(body), len(name), timeout) + name + body)
            head = _read(conn, REPLY.size)
            if head is None:
                raise ConnectionError("the service closed the connection")
            size, status = REPLY.unpack(head)
            data = _read(conn, size)
            if data is None:
                raise ConnectionError("the service closed the connection")
        except socket.timeout:
            conn.close()  # its reply may still come: the connection is not reused
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply in {timeout:.2f}s") from None
        except OSError as error:  # refused, gone, reset, closed
            if conn is not None:
                conn.close()
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, f"local socket {self.path}: {error}") from None
        with self.lock:
            self.idle.append(conn)
        if status:
            raise LocalRpcError(CODES.get(status, grpc.StatusCode.UNKNOWN), data.decode(errors="replace"))
        return _method(full_name)[1].FromString(data)

    def close(self) -> None:
        with self.lock:
            for conn in self.idle:
                conn.close()
            self.idle.clear()
