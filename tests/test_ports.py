"""A port in use is an error naming it: no server shares a port with another (gRPC's SO_REUSEPORT
is off), and every program stops at start, with one line, rather than serve beside another."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from specbatch.rpc.metrics import new_registry, serve_metrics
from specbatch.rpc.server import PortUnavailable, Server
from specbatch.rpc.tls import server_credentials
from specbatch.stack.defaults import StackOptions
from specbatch.stack.processes import LocalProcesses

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def taken():
    """A port a running server holds."""
    server = Server("127.0.0.1:0", max_workers=2).start()
    yield server.port
    server.stop(0)


def test_a_second_server_on_a_port_in_use_is_refused_naming_it(taken):
    started = time.monotonic()
    with pytest.raises(PortUnavailable, match=f"port {taken} is in use"):
        Server(f"127.0.0.1:{taken}", max_workers=2)
    assert time.monotonic() - started < 2


def test_a_port_held_by_a_server_that_allows_sharing_is_refused_too():
    """A gRPC server with SO_REUSEPORT on (gRPC's default: an older specbatch, another program)
    would share its port with any other that sets it; ours does not, so the bind fails."""
    other = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        with pytest.raises(PortUnavailable, match=f"port {port}"):
            Server(f"127.0.0.1:{port}", max_workers=2)
    finally:
        other.stop(0)


def test_a_plaintext_server_on_a_tls_servers_port_is_refused(tmp_path):
    from test_tls import Pki  # the TLS tests' certificates

    pki = Pki(tmp_path)
    tls = Server("127.0.0.1:0", max_workers=2, credentials=server_credentials(pki.server_cert, pki.server_key)).start()
    try:
        with pytest.raises(PortUnavailable, match=f"port {tls.port}"):
            Server(f"127.0.0.1:{tls.port}", max_workers=2)
    finally:
        tls.stop(0)


def test_metrics_on_a_port_in_use_stop_the_process_naming_it(taken):
    with pytest.raises(SystemExit, match=f"127.0.0.1:{taken}"):
        serve_metrics(new_registry(), "target", "127.0.0.1", taken)


def _exits(command: list[str], timeout: float) -> tuple[int, str, float]:
    started = time.monotonic()
    process = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    return process.returncode, process.stderr, time.monotonic() - started


@pytest.mark.parametrize("program", ["target_service", "coordinator"])
def test_a_program_on_a_port_in_use_exits_with_one_line_naming_it(taken, program, tmp_path):
    """Before its imports of seconds, any model load (the model named does not exist) or any wait for
    the services (none serve at the addresses given): the process exits 1, saying why in one line."""
    flags = {"target_service": ["--model", str(tmp_path / "no-model")],
             "coordinator": ["--target", "127.0.0.1:1", "--draft", "none"]}[program]
    code, stderr, seconds = _exits([sys.executable, "-m", program, "--port", str(taken), "--metrics-port", "0",
                                    *flags], timeout=120)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 1 and lines[-1] == f"cannot listen on 127.0.0.1:{taken}: port {taken} is in use", stderr
    assert "Traceback" not in stderr
    assert seconds < 2, f"{program} took {seconds:.2f} s to refuse the port"


def test_up_on_a_port_in_use_exits_before_starting_anything(taken, monkeypatch):
    from specbatch.commands import cli

    started: list = []
    monkeypatch.setattr(LocalProcesses, "start", lambda self, timeout=600.0: started.append(self))
    with pytest.raises(SystemExit, match=f"port {taken} is in use"):
        cli.main(["up", "--port", str(taken), "--random-weights", "--target-model", "smollm2-135m"])
    assert started == []
    stack = LocalProcesses(StackOptions(k_policy="fixed:3", device="cpu", port=taken))
    with pytest.raises(PortUnavailable, match=f"port {taken}"):
        stack.check_ports()
