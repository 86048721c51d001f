#!/usr/bin/env python3
"""Where a captured step's time goes on a GPU: the graph's own GPU time against the whole call.

bench-engine times a verify or propose call from host to host. On a GPU with captured steps
that time is the CUDA graph's kernels plus everything around them: building the call's inputs on
the host, copying them into the static buffers, the acceptance rule, the one synchronisation, and
Python. This script times the same calls (``specbatch.commands.bench.engine.Bench``) and records
CUDA events around every graph replay, so each cell splits into

  graph: GPU time between the events around each replay (summed over a call's forwards),
  rest:  the call's wall time less that: host work the GPU waited for, and kernels outside graphs.

A call whose ``rest`` is large is bound by the host; one whose ``graph`` is near its wall time is
bound by the kernels inside the graph (their count and size, not their launches).

    python3 benchmarks/step_split.py --random-weights --target-model smollm2-135m \\
        --draft-model smollm2-135m-instruct-draft [--batch-sizes 1,8,32 --tokens 1,4 --ks 1,4]

On a CPU (no graphs: ``--cuda-graphs static``) only the wall time is reported. Writes the cells to
benchmarks/results/<machine>/step-split.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch

from draft_service.proposer import ProposeItem, proposals
from specbatch.commands import results
from specbatch.commands.bench.engine import Bench, Grid, _sizes
from specbatch.engine.captured import CapturedForward
from specbatch.engine.engine import Engine
from specbatch.models.loading import ModelSpec, default_device, load_model
from target_service.verifier import VerifyItem, verify


class TimedGraph:
    """A captured graph whose replays record CUDA events around them."""

    def __init__(self, graph, events: list):
        self.graph, self.events = graph, events

    def replay(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        self.events.append((start, end))


def timed(engine: Engine) -> list:
    """Wrap the engine's captured graphs; returns the list their replays append events to."""
    events: list = []
    forward = engine.forward
    if isinstance(forward, CapturedForward):
        forward.graphs = {bucket: TimedGraph(graph, events) for bucket, graph in forward.graphs.items()}
        capture_one = forward._capture_one

        def capture_timed(bucket):  # --cuda-graphs lazy: graphs captured later are timed too
            forward.graphs[bucket] = TimedGraph(capture_one(bucket), events)
            return forward.graphs[bucket]

        forward._capture_one = capture_timed
    return events


def split(bench: Bench, events: list, call, repeats: int, warmup: int) -> dict:
    cuda = bench.device.type == "cuda"
    walls, graphs, replays = [], [], []
    for i in range(warmup + repeats):
        if cuda:
            torch.cuda.synchronize()
        events.clear()
        start = time.perf_counter()
        bench.engine.run(call)
        if cuda:
            torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - start)
        if i >= warmup:
            walls.append(wall)
            graphs.append(sum(s.elapsed_time(e) for s, e in events) if cuda else 0.0)
            replays.append(len(events))
    wall, graph = statistics.median(walls), statistics.median(graphs)
    return {"wall_ms": round(wall, 3), "graph_ms": round(graph, 3), "rest_ms": round(wall - graph, 3),
            "replays": statistics.median(replays)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-model", default="smollm2-135m")
    parser.add_argument("--draft-model")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--device")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--cuda-graphs", default="auto")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--tokens", default="1,4")
    parser.add_argument("--ks", default="1,4")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--kv-cache-gb", type=float, default=8.0)
    parser.add_argument("--no-fast-decode", action="store_true",
                        help="draft decode steps through CapturedForward.__call__, as before its decode() (to compare)")
    parser.add_argument("--trace", action="store_true",
                        help="also torch.profiler's table of the smallest cell of each call (host ops, kernels outside graphs)")
    results.add_output_flags(parser, "step-split")
    args = parser.parse_args()
    grid = Grid(_sizes(args.batch_sizes, "--batch-sizes"), _sizes(args.tokens, "--tokens"), _sizes(args.ks, "--ks"),
                args.context, args.repeats, args.warmup)
    device = args.device or default_device()
    longest = grid.context + max(max(grid.tokens), max(grid.ks))

    def engine_for(name: str) -> Engine:
        model = load_model(ModelSpec(name, random_weights=args.random_weights), device, args.dtype)
        return Engine(model, max_sequences=max(grid.batch_sizes), max_context=longest,
                      max_cache_bytes=int(args.kv_cache_gb * 2**30), captured_steps=args.cuda_graphs)

    print(f"decode steps: {'the full call' if args.no_fast_decode else 'CapturedForward.decode'}\n")
    print("| call | batch | tokens or k | wall ms | graph ms (GPU) | rest ms | forwards |")
    print("|---|---|---|---|---|---|---|")
    traces: list[tuple[str, str]] = []
    rows = []
    models = [("verify", args.target_model)] + ([("propose", args.draft_model)] if args.draft_model else [])
    for kind, name in models:
        engine = engine_for(name)
        if args.no_fast_decode and isinstance(engine.forward, CapturedForward):
            engine.forward.decode = None  # RaggedBatch.decode then takes the full call
        events = timed(engine)
        bench = Bench(engine, grid)
        try:
            for b in grid.batch_sizes:
                for n in (grid.tokens if kind == "verify" else grid.ks):
                    # The call over this cell's items, bound now (the loop moves on; the engine is
                    # deleted below).
                    if kind == "verify":
                        items = [VerifyItem(bench._next(i), bench.tokens[i][: n - 1]) for i in range(b)]
                        call = functools.partial(verify, bench.engine, items)
                    else:
                        items = [ProposeItem(bench._next(i), n) for i in range(b)]
                        call = functools.partial(proposals, bench.engine, items)
                    cell = split(bench, events, call, grid.repeats, grid.warmup)
                    rows.append({"call": f"{kind} {name}", "batch": b, "tokens or k": n, **cell})
                    print(f"| {kind} {name} | {b} | {n} | {cell['wall_ms']:.2f} | {cell['graph_ms']:.2f} | "
                          f"{cell['rest_ms']:.2f} | {cell['replays']:g} |", flush=True)
                    if args.trace and (b, n) == (grid.batch_sizes[0], (grid.tokens if kind == "verify" else grid.ks)[-1]):
                        traces.append((f"{kind} {name}, batch {b}, {n}", profile(bench, items, kind)))
        finally:
            bench.close()
        del bench, engine
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    for title, table in traces:
        print(f"\n### torch.profiler, 10 calls: {title}\n\n{table}")
    results.write("step-split", {"random_weights": args.random_weights, "cuda_graphs": args.cuda_graphs,
                                 "fast_decode": not args.no_fast_decode, "context": grid.context, "rows": rows},
                  out=args.out, variant=args.variant, device=device)
    return 0


def profile(bench: Bench, items, kind: str) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine = bench.engine
    call = (lambda: verify(engine, items)) if kind == "verify" else (lambda: proposals(engine, items))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.device.type == "cuda" else [])

    def ten():
        with torch_profile(activities=activities) as prof:
            for _ in range(10):
                call()
            if bench.device.type == "cuda":
                torch.cuda.synchronize()
        return prof

    prof = engine.run(ten)
    key = "self_cuda_time_total" if bench.device.type == "cuda" else "self_cpu_time_total"
    return (prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18) + "\n"
            + prof.key_averages().table(sort_by=key, row_limit=12))


if __name__ == "__main__":
    sys.exit(main())
