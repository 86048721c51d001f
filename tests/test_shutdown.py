"""Stopping the stack: the coordinator drains before the services stop, and nothing of a stack
outlives its launcher, kill -9 included."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tiny import greedy_reference

from specbatch.rpc.client import connect, make_request
from specbatch.stack.defaults import StackOptions, free_port
from specbatch.stack.processes import LocalProcesses
from specbatch.v1 import generation_pb2 as gpb

ROOT = Path(__file__).resolve().parents[1]


def poll(condition, timeout: float, what: str, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(every)
    return value


class FakeProcess:
    """A child that records the signals it gets and exits on SIGTERM, for ``stop``'s order."""

    def __init__(self, name: str, events: list):
        self.name, self.events, self.returncode = name, events, None

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.events.append(("signal", self.name))
        self.returncode = 0

    def wait(self, timeout=None):
        self.events.append(("wait", self.name, timeout))
        return self.returncode

    def kill(self):
        self.events.append(("kill", self.name))


def test_stop_signals_the_services_only_once_the_coordinators_have_drained(monkeypatch):
    """Each coordinator is signalled first and waited for through its --drain-seconds (and the
    timeout beyond it); only then are the services signalled."""
    monkeypatch.setattr(LocalProcesses, "_wait_until_serving", lambda self, addresses, timeout: None)
    events: list = []
    stack = LocalProcesses(StackOptions(k_policy="fixed:3", device="cpu", drain_seconds=45.0, local_sockets=False,
                                        separate_draft=True),
                           lambda module, args, env: FakeProcess(module, events)).start()
    stack.add_coordinator("fixed:2", 1, extra_flags=("--drain-seconds", "70"))
    stack.stop(timeout=15.0)
    signalled = [e[1] for e in events if e[0] == "signal"]
    assert signalled[:2] == ["coordinator", "coordinator"]
    assert sorted(signalled[2:]) == ["draft_service", "target_service"]
    first_service = events.index(("signal", signalled[2]))
    waits = [e for e in events[:first_service] if e[0] == "wait"]
    assert len(waits) == 2 and waits[0][2] > 70.0  # the longest drain, and the timeout beyond it
    assert all(e[2] <= 15.0 for e in events[first_service:] if e[0] == "wait")
    assert not [e for e in events if e[0] == "kill"]


def _not_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_stop_lets_running_streams_finish(tmp_path, target_model, tokenizer, zygote):
    """8 streams held by the coordinator when the stack is stopped all finish, whole and exact, and
    every process exits 0. The target is paused (SIGSTOP) from before the streams until the
    coordinator is draining, so none can have finished before the stop: a service stopped beside
    the coordinator, or a drain that let go of requests still being prefilled, would end them short."""
    target_model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ports = {"coordinator": free_port(), "target": free_port(), "draft": free_port()}
    stack = LocalProcesses(StackOptions(target_model=str(tmp_path), dtype="float32", draft_model=str(tmp_path),
                                        draft_layers=2, ports=ports, max_batch_size=8, k_policy="fixed:3"),
                           zygote.start).start(timeout=180)
    children = dict(stack.processes)
    prompts = [[1, 7 + n, 22, 9] for n in range(8)]
    results: list = [None] * 8

    def read(n: int, stream) -> None:
        tokens, last, code = [], None, grpc.StatusCode.OK
        try:
            for response in stream:
                tokens += response.token_ids
                last = response
        except grpc.RpcError as error:
            code = error.code()
        results[n] = (tokens, last.finish_reason if last else None, code)

    client = connect(stack.address)
    stopper = threading.Thread(target=stack.stop)
    os.kill(children["target"].pid, signal.SIGSTOP)
    try:
        streams = [client.Generate(make_request(p, 150, ignore_eos=True), timeout=120) for p in prompts]
        readers = [threading.Thread(target=read, args=(n, stream)) for n, stream in enumerate(streams)]
        for reader in readers:
            reader.start()
        poll(lambda: sum(load(client)) == 8, 30, "the coordinator holds the 8 requests")
        stopper.start()
        poll(lambda: _not_serving(stack.address), 30, "the coordinator drains")
    finally:
        os.kill(children["target"].pid, signal.SIGCONT)
    stopper.join(120)
    for reader in readers:
        reader.join(60)
    for n, prompt in enumerate(prompts):
        tokens, finish, code = results[n]
        assert code == grpc.StatusCode.OK and finish == gpb.FINISH_REASON_LENGTH
        assert tokens == greedy_reference(target_model, prompt, 150)
    assert not stopper.is_alive()
    assert {name: p.returncode for name, p in children.items()} == {"target": 0, "draft": 0, "coordinator": 0}


def load(client) -> tuple[int, int]:
    info = client.Info(gpb.InfoRequest(), timeout=5)
    return info.running, info.waiting


def _free_ports_in_a_row(count: int) -> int:
    """A port P with P … P + count - 1 all free now (``specbatch up`` takes the next two)."""
    for _ in range(100):
        base = free_port()
        held = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no free ports in a row")


def _children_of(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    return children


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (its new parent may be slow to reap it)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="children die with their parent on Linux")
def test_nothing_outlives_a_launcher_killed_with_sigkill(tmp_path, target_model, tokenizer):
    """kill -9 of `specbatch up`: its three processes exit and the socket folder is removed."""
    model = tmp_path / "model"
    target_model.save_pretrained(model)
    tokenizer.save_pretrained(model)
    # The launcher's temporary folder, where it makes the socket folder: short, as a socket's path must be.
    sockets = Path(tempfile.mkdtemp(prefix="sb-"))
    port = _free_ports_in_a_row(3)
    env = {**os.environ, "TMPDIR": str(sockets), "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "specbatch.commands.cli", "up", "--target-model", str(model),
                                 "--draft-layers", "2", "--dtype", "float32", "--k-policy", "fixed:3",
                                 "--threads", "1", "--port", str(port)],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in launcher.stdout:
            lines.put(line)
        lines.put("")  # it exited

    threading.Thread(target=read, daemon=True).start()
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while "serving on" not in (line := lines.get(timeout=max(0.0, deadline - time.monotonic()))):
            assert line, f"the launcher exited with code {launcher.wait()}"
        children += _children_of(launcher.pid)
        assert len(children) == 3 and len(list(sockets.iterdir())) == 1
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        poll(lambda: not any(map(_alive, children)) and not list(sockets.iterdir()), 5,
             "every child gone and the socket folder removed")
        print(f"0 processes and no socket folder {time.monotonic() - killed:.2f} s after kill -9")
    finally:
        launcher.kill()
        for pid in children or _children_of(launcher.pid):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()
        shutil.rmtree(sockets, ignore_errors=True)
