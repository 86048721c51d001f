"""What one gRPC round trip costs between two processes, by the idle gap before it, beside the same
call over the services' local socket (specbatch/rpc/local.py).

A model service at batch 1 sleeps between its calls (the other service or the target's forward
runs meanwhile). This measures an empty unary call (a Verify whose handler only stamps the
time) from a client process to a server process started as the services are (a sync gRPC server,
a thread pool), calls ``gap`` ms apart: the time to reach the handler and the reply's way back;
over the local socket also with the stamp taken on a model thread, handed over to it (``Engine.run``
from another thread: what that hand-over adds), and on a socket that the model thread serves
itself, as the services' sockets are (``LocalServer(loop=…)``).
Beside it, a pipe round trip between two processes after the same gap: what waking a sleeping
process costs on this machine without gRPC's threads.

    .venv/bin/python benchmarks/rpc_gap.py [--gaps 0.5,2,5,12,40] [--calls 150]

Writes the rows to benchmarks/results/<machine>/rpc-gap.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from specbatch.commands import results  # noqa: E402
from specbatch.engine.model_thread import ModelThread  # noqa: E402
from specbatch.rpc.local import LocalChannel, LocalServer  # noqa: E402
from specbatch.rpc.server import Server  # noqa: E402
from specbatch.stack.defaults import free_port  # noqa: E402
from specbatch.v1 import model_services_pb2 as pb  # noqa: E402
from specbatch.v1 import model_services_pb2_grpc as pb_grpc  # noqa: E402


class StampingTarget(pb_grpc.TargetServicer):
    # A Verify whose first item keeps 1 token stamps on the model thread, as the services' calls
    # run (``Engine.run``: handed over to it where the call arrived on another thread).
    model_thread = ModelThread()

    def Verify(self, request, context):
        # perf_counter is CLOCK_MONOTONIC: the same clock in both processes.
        if request.items and request.items[0].sequence.keep_len == 1 and not self.model_thread.on_thread():
            return self.model_thread.submit(lambda: pb.VerifyResponse(compute_seconds=time.perf_counter())).result()
        return pb.VerifyResponse(compute_seconds=time.perf_counter())


def serve(port: int, socket_dir: str) -> None:
    server = Server(f"127.0.0.1:{port}", max_workers=8)
    servicer = StampingTarget()
    server.add(pb_grpc.add_TargetServicer_to_server, servicer, "specbatch.v1.Target")
    server.serve_locally(socket_dir, "stamping")  # the same servicer on a Unix socket (local_rpc.py)
    # … and on a second one that the model thread serves itself, as the services' sockets are.
    (Path(socket_dir) / "served").mkdir()
    served = LocalServer(Path(socket_dir) / "served", "stamping", loop=servicer.model_thread)
    served.add(servicer, "specbatch.v1.Target")
    served.start()
    server.start()
    server.grpc_server.wait_for_termination()


def pipe_round_trip(gap: float, calls: int) -> float:
    """Median round trip of one byte to a child process and back, ``gap`` seconds apart."""
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(from_parent)  # else the parent's close never reaches this read as the end
        while os.read(to_child, 1):
            os.write(from_child, b"x")
        os._exit(0)
    os.close(to_child)
    os.close(from_child)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        os.write(from_parent, b"x")
        os.read(to_parent, 1)
        times.append(time.perf_counter() - start)
        time.sleep(gap)
    os.close(from_parent)
    os.waitpid(pid, 0)
    os.close(to_parent)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gaps", default="0.5,1,2,5,12,40", help="ms between calls, comma-separated")
    parser.add_argument("--calls", type=int, default=150)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server process
    parser.add_argument("--socket-dir", help=argparse.SUPPRESS)
    results.add_output_flags(parser, "rpc-gap")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.socket_dir)
        return
    gaps = [float(g) / 1e3 for g in args.gaps.split(",")]
    # Pipes first: a fork once gRPC's threads run could hang in its fork handlers.
    pipes = {gap: pipe_round_trip(gap, args.calls) for gap in gaps}
    port = free_port()
    socket_dir = tempfile.mkdtemp(prefix="rpc-gap-")
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--socket-dir", socket_dir])
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = pb_grpc.TargetStub(channel)
        local = LocalChannel(next(Path(socket_dir).glob("*.sock")).as_posix())
        served = LocalChannel(next(Path(socket_dir, "served").glob("*.sock")).as_posix())
        def request(keep_len: int):
            return pb.VerifyRequest(items=[pb.VerifyItem(sequence=pb.SequenceInput(seq_id="a", keep_len=keep_len,
                                                                                   tokens=[1, 2, 3]))])

        plain, hopping = request(100), request(1)
        calls = {"gRPC": lambda: stub.Verify(plain),
                 "local socket": lambda: local.call("/specbatch.v1.Target/Verify", plain, 10.0),
                 "local socket, handed to the model thread": lambda: local.call("/specbatch.v1.Target/Verify",
                                                                                  hopping, 10.0),
                 "local socket served by the model thread": lambda: served.call("/specbatch.v1.Target/Verify",
                                                                                 hopping, 10.0)}
        for call in calls.values():
            for _ in range(20):
                call()
        print("| gap between calls | " + " | ".join(f"{name}: to the handler | {name}: back to the client"
                                                  for name in calls) + " | pipe round trip |")
        print("|---|" + "---|---|" * len(calls) + "---|")
        rows = []
        for gap in gaps:
            times = {name: ([], []) for name in calls}
            for _ in range(args.calls):
                for name, call in calls.items():  # taking turns
                    sent = time.perf_counter()
                    reply = call()
                    received = time.perf_counter()
                    times[name][0].append(reply.compute_seconds - sent)
                    times[name][1].append(received - reply.compute_seconds)
                    time.sleep(gap)
            print(f"| {gap * 1e3:g} ms | " + " | ".join(f"{statistics.median(there) * 1e3:.3f} ms | "
                                                        f"{statistics.median(back) * 1e3:.3f} ms"
                                                        for there, back in times.values())
                  + f" | {pipes[gap] * 1e6:.0f} µs |", flush=True)
            rows.append({"gap_ms": gap * 1e3, **{f"{name}: {way} ms": statistics.median(times[name][i]) * 1e3
                                                  for name in calls for i, way in enumerate(("to the handler", "back"))},
                         "pipe round trip ms": pipes[gap] * 1e3})
        local.close()
        served.close()
        channel.close()
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(socket_dir, ignore_errors=True)
    results.write("rpc-gap", {"calls": args.calls, "rows": rows}, out=args.out, variant=args.variant, device="cpu")


if __name__ == "__main__":
    main()
