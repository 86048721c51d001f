"""The one thread an engine's forwards run on, which also serves the connections handed to it.

Forwards always run on one thread: each thread that calls into torch gets its own OpenMP team,
and teams left behind by other threads spin and steal the cores (docs/decisions/threads.md).
A call that arrives on another thread is handed over (``submit``) and its result handed back:
two wake-ups of sleeping threads per call. A call that arrives on a connection this thread
watches (``watch``: the services' local sockets, specbatch/rpc/local.py) is read, run and
answered here, without either (docs/decisions/local-sockets.md).

Jobs run before connections are looked at again, one at a time, in the order submitted.
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import threading
from concurrent import futures

log = logging.getLogger(__name__)


class ModelThread:
    """``submit`` as a one-worker ThreadPoolExecutor's, plus ``watch``: call ``on_readable()`` on
    this thread whenever ``sock`` has something to read, until ``unwatch``. The thread starts at
    the first ``submit`` or ``watch``."""

    def __init__(self, name: str = "model"):
        self.name = name
        self._jobs: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._selector: selectors.BaseSelector | None = None
        self._wake_read: socket.socket | None = None
        self._wake_write: socket.socket | None = None

    def on_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def submit(self, fn, *args, **kwargs) -> futures.Future:
        future: futures.Future = futures.Future()
        self._start()
        self._jobs.append((future, fn, args, kwargs))
        self._wake()
        return future

    def watch(self, sock: socket.socket, on_readable) -> None:
        """Serve ``sock`` here: ``on_readable()`` runs on this thread each time it is readable (and
        blocks this thread while it runs: it should read what is there and answer)."""
        if self.on_thread():
            self._selector_register(sock, on_readable)
        else:
            self.submit(self._selector_register, sock, on_readable)

    def unwatch(self, sock: socket.socket) -> None:
        """Stop serving ``sock`` (on this thread, or from any other: then at the next turn)."""
        if self.on_thread():
            self._selector_unregister(sock)
        elif self._thread is not None:
            self.submit(self._selector_unregister, sock)

    def _selector_register(self, sock, on_readable) -> None:
        self._selector.register(sock, selectors.EVENT_READ, on_readable)

    def _selector_unregister(self, sock) -> None:
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):  # never watched, or already closed
            pass

    def _start(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is not None:
                return
            self._selector = selectors.DefaultSelector()
            self._wake_read, self._wake_write = socket.socketpair()
            self._wake_read.setblocking(False)
            self._wake_write.setblocking(False)
            self._selector.register(self._wake_read, selectors.EVENT_READ, None)
            thread = threading.Thread(target=self._loop, name=f"{self.name}_0", daemon=True)
            thread.start()
            self._thread = thread

    def _wake(self) -> None:
        try:
            self._wake_write.send(b"\0")
        except BlockingIOError:  # the buffer is full of wake-ups: the thread will look anyway
            pass

    def _loop(self) -> None:
        while True:
            while self._jobs:
                future, fn, args, kwargs = self._jobs.popleft()
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn(*args, **kwargs)
                except BaseException as error:  # noqa: BLE001 - the caller's to see
                    future.set_exception(error)
                else:
                    future.set_result(result)
                del future, fn, args, kwargs
            for key, _ in self._selector.select(timeout=0 if self._jobs else None):
                if key.data is None:  # a wake-up: the jobs run at the top of the loop
                    try:
                        while self._wake_read.recv(4096):
                            pass
                    except BlockingIOError:
                        pass
                else:
                    try:
                        key.data()
                    except Exception:  # noqa: BLE001 - one connection's failure: the thread serves on
                        log.exception("serving a watched connection failed: no longer watched")
                        self._selector_unregister(key.fileobj)
