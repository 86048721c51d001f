"""An engine's ModelThread (specbatch/engine/model_thread.py): one thread runs the jobs handed to
it, in order, and serves the connections it watches between them."""

import socket
import threading

import pytest

from specbatch.engine.model_thread import ModelThread


def test_jobs_run_in_order_on_one_thread_and_return_or_raise():
    loop = ModelThread()
    threads = [loop.submit(threading.current_thread).result(5) for _ in range(3)]
    assert len(set(threads)) == 1 and threads[0] is not threading.current_thread()
    order = []
    jobs = [loop.submit(order.append, i) for i in range(50)]
    for job in jobs:
        job.result(5)
    assert order == list(range(50))
    with pytest.raises(ZeroDivisionError):
        loop.submit(lambda: 1 / 0).result(5)
    assert loop.submit(lambda: "still serving").result(5) == "still serving"


def test_a_watched_socket_is_served_on_the_thread_between_jobs():
    loop = ModelThread()
    ours, theirs = socket.socketpair()
    served_on, done = [], threading.Event()

    def on_readable():
        data = ours.recv(64)
        served_on.append(threading.current_thread())
        if data == b"job?":  # a job submitted from the loop's own thread runs after this one
            loop.submit(lambda: ours.sendall(b"after"))
        ours.sendall(b"re:" + data)
        done.set()

    loop.watch(ours, on_readable)
    theirs.settimeout(5)
    theirs.sendall(b"ping")
    assert theirs.recv(64) == b"re:ping"
    theirs.sendall(b"job?")
    assert theirs.recv(7) == b"re:job?"
    assert theirs.recv(5) == b"after"
    assert served_on[0] is loop.submit(threading.current_thread).result(5)
    loop.unwatch(ours)
    loop.submit(lambda: None).result(5)  # the unwatch has run
    done.clear()
    theirs.sendall(b"unseen")
    assert not done.wait(0.2)
    assert ours.recv(64) == b"unseen"  # still there: nobody read it
    ours.close()
    theirs.close()


def test_a_watched_connection_that_fails_is_dropped_and_the_thread_serves_on(caplog):
    loop = ModelThread()
    ours, theirs = socket.socketpair()
    failed, calls = threading.Event(), []

    def on_readable():
        calls.append(ours.recv(64))
        failed.set()
        raise RuntimeError("a handler bug")

    loop.watch(ours, on_readable)
    theirs.sendall(b"x")
    assert failed.wait(5)
    assert loop.submit(lambda: 1).result(5) == 1
    assert "a handler bug" in caplog.text
    theirs.sendall(b"y")  # no longer watched: left unread
    assert loop.submit(lambda: 2).result(5) == 2
    assert calls == [b"x"] and ours.recv(64) == b"y"
    assert loop.submit(lambda: "still serving").result(5) == "still serving"
    ours.close()
    theirs.close()
