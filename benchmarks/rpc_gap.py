"""What one gRPC round trip costs between two processes, by the idle gap before it.

A model service at batch 1 sleeps 3-15 ms between its calls (the other service or the target's
forward runs meanwhile). This measures an empty unary call (a Verify whose handler only stamps the
time) from a client process to a server process started as the services are (a sync gRPC server,
a thread pool), calls ``gap`` ms apart: the time to reach the handler and the reply's way back.
Beside it, a pipe round trip between two processes after the same gap: what waking a sleeping
process costs on this machine without gRPC's threads.

    .venv/bin/python benchmarks/rpc_gap.py [--gaps 0.5,2,5,12,40] [--calls 150]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from specbatch.commands.launcher import free_port  # noqa: E402
from specbatch.serving import Server  # noqa: E402
from specbatch.v1 import model_services_pb2 as pb  # noqa: E402
from specbatch.v1 import model_services_pb2_grpc as pb_grpc  # noqa: E402


class StampingTarget(pb_grpc.TargetServicer):
    def Verify(self, request, context):
        # perf_counter is CLOCK_MONOTONIC: the same clock in both processes.
        return pb.VerifyResponse(compute_seconds=time.perf_counter())


def serve(port: int) -> None:
    server = Server(f"127.0.0.1:{port}", max_workers=8)
    server.add(pb_grpc.add_TargetServicer_to_server, StampingTarget(), "specbatch.v1.Target")
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
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    gaps = [float(g) / 1e3 for g in args.gaps.split(",")]
    # Pipes first: a fork once gRPC's threads run could hang in its fork handlers.
    pipes = {gap: pipe_round_trip(gap, args.calls) for gap in gaps}
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = pb_grpc.TargetStub(channel)
        request = pb.VerifyRequest(items=[pb.VerifyItem(sequence=pb.SequenceInput(seq_id="a", keep_len=100,
                                                                                  tokens=[1, 2, 3]))])
        for _ in range(20):
            stub.Verify(request)
        print("| gap between calls | gRPC: to the handler | gRPC: back to the client | pipe round trip |")
        print("|---|---|---|---|")
        for gap in gaps:
            there, back = [], []
            for _ in range(args.calls):
                sent = time.perf_counter()
                reply = stub.Verify(request)
                received = time.perf_counter()
                there.append(reply.compute_seconds - sent)
                back.append(received - reply.compute_seconds)
                time.sleep(gap)
            print(f"| {gap * 1e3:g} ms | {statistics.median(there) * 1e3:.3f} ms | "
                  f"{statistics.median(back) * 1e3:.3f} ms | {pipes[gap] * 1e6:.0f} µs |", flush=True)
        channel.close()
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
