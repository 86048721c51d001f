#!/usr/bin/env python3
"""Where a served step's time goes beyond the services' compute, at batch 1 (or `--batch N`).

Starts the two model services as `specbatch up` does (local sockets, threads, metrics ports) and
drives the coordinator's scheduler by hand, one step at a time (as `specbatch profile` does), at
each k of ``--ks``. Per k it prints the medians of the step, of each call's wall time and of the
compute the service reports for it, and from the services' own Prometheus sums the mean time a
call spent in its handler beyond the engine call. What is left of a call's wall time beyond the
handler is the transport: the wake-ups between the processes.

    .venv/bin/python benchmarks/call_overhead.py [--ks 0,1,2,3,5] [--steps 150] [--grpc-only]
        [--device cuda --dtype bfloat16]

Writes the rows to benchmarks/results/<machine>/call-overhead.json (or ``--out``; ``--variant`` names
apart runs over gRPC or at other batch sizes).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.backends import DraftClient, TargetClient  # noqa: E402
from coordinator.policy import FixedK  # noqa: E402
from specbatch.commands import results  # noqa: E402
from specbatch.commands.profiler import batch_by_hand  # noqa: E402
from specbatch.commands.prompts import chat_prompts, sharegpt_prompts  # noqa: E402
from specbatch.config.options import DEFAULT_METRICS_PORTS
from specbatch.models.embedded import EMBEDDED  # noqa: E402
from specbatch.models.loading import ModelSpec, load_tokenizer
from specbatch.stack.defaults import StackOptions
from specbatch.stack.processes import LocalProcesses  # noqa: E402

WARMUP_STEPS = 10


def handler_sums(port: int) -> dict:
    """{(histogram, method, "sum" | "count"): value} of the service's handler and compute times."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    sums = {}
    for name, short in (("specbatch_service_compute_seconds", "compute"), ("specbatch_service_request_seconds", "handler")):
        for match in re.finditer(name + r'_(sum|count)\{method="(\w+)"\} ([0-9.e+-]+)', text):
            sums[short, match.group(2), match.group(1)] = float(match.group(3))
    return sums


def beyond_compute_ms(before: dict, after: dict, method: str) -> float | None:
    """Mean handler time less mean compute time of ``method``'s calls between two readings."""
    calls = after.get(("compute", method, "count"), 0) - before.get(("compute", method, "count"), 0)
    if not calls:
        return None
    spent = {part: after[part, method, "sum"] - before.get((part, method, "sum"), 0) for part in ("handler", "compute")}
    return 1e3 * (spent["handler"] - spent["compute"]) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="0,1,2,3,5")
    parser.add_argument("--steps", type=int, default=150, help="measured steps a k")
    parser.add_argument("--batch", type=int, default=1, help="sequences a step (each its own prompt)")
    parser.add_argument("--prompt-lookup", type=int, default=0,
                        help="the coordinator's --prompt-lookup (default 0 here: every step drafts)")
    parser.add_argument("--grpc-only", action="store_true", help="the calls through gRPC, not the local sockets")
    parser.add_argument("--device", help="the services' device (default: as specbatch up picks)")
    parser.add_argument("--dtype", help="the services' dtype (default: as specbatch up picks)")
    results.add_output_flags(parser, "call-overhead")
    args = parser.parse_args()
    tokenizer = load_tokenizer(ModelSpec(EMBEDDED))
    prompts = chat_prompts(tokenizer, sharegpt_prompts(args.batch, 0), 200)
    options = StackOptions(coordinator=False, metrics_ports=dict(DEFAULT_METRICS_PORTS), local_sockets=not args.grpc_only,
                           device=args.device, dtype=args.dtype)
    print(f"batch {args.batch}, the calls over {'gRPC' if args.grpc_only else 'local sockets'}, {args.steps} steps a k "
          "(medians; coordinator: the step less its two calls' walls; handler − compute: means from the services' "
          "metrics), ms:")
    print("| k | step ms | Propose wall / compute | Verify wall / compute | coordinator | Propose handler − compute "
          "| Verify handler − compute |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    with LocalProcesses(options) as processes:
        # A draft hosted in the target's process (on a CPU) is served, and measured, by the target's.
        hosted = processes.draft_address == processes.target_address
        ports = {"target": DEFAULT_METRICS_PORTS["target"], "draft": DEFAULT_METRICS_PORTS["target" if hosted else "draft"]}
        target = TargetClient(processes.target_address, timeout=600)
        draft = DraftClient(processes.draft_address, timeout=600)
        feature_size = draft.cache_stats().feature_size
        target.cache_stats()  # (adopts the local socket where there is one)
        for k in (int(k) for k in args.ks.split(",")):
            with batch_by_hand(target, draft, prompts, tokenizer, 2048, feature_size, prompt_lookup=args.prompt_lookup,
                               name=f"k{k}") as (scheduler, requests):
                scheduler.policy = FixedK(k)
                steps = []
                for i in range(WARMUP_STEPS + args.steps):
                    if i == WARMUP_STEPS:
                        before = {name: handler_sums(port) for name, port in ports.items()}
                    stats = scheduler.step()
                    if stats is None or any(request.finish is not None for request in requests):
                        raise SystemExit(f"the step at k = {k} ended early (a service down, or the context full)")
                    if i >= WARMUP_STEPS:
                        steps.append((stats.step_seconds, stats.draft_seconds, stats.draft_compute_seconds,
                                      stats.target_seconds, stats.target_compute_seconds,
                                      stats.step_seconds - stats.draft_seconds - stats.target_seconds))
                after = {name: handler_sums(port) for name, port in ports.items()}
            step, propose, propose_compute, verify, verify_compute, own = (1e3 * statistics.median(c) for c in zip(*steps))
            extra = [beyond_compute_ms(before[name], after[name], method)
                     for name, method in (("draft", "Propose"), ("target", "Verify"))]
            print(f"| {k} | {step:.2f} | " + (f"{propose:.2f} / {propose_compute:.2f}" if k else "–")
                  + f" | {verify:.2f} / {verify_compute:.2f} | {own:.2f} | "
                  + " | ".join("–" if e is None else f"{e:.2f}" for e in extra) + " |", flush=True)
            rows.append({"k": k, "step_ms": step, "propose_ms": propose if k else None,
                         "propose_compute_ms": propose_compute if k else None, "verify_ms": verify,
                         "verify_compute_ms": verify_compute, "coordinator_ms": own,
                         "propose_handler_beyond_compute_ms": extra[0], "verify_handler_beyond_compute_ms": extra[1]})
    results.write("call-overhead", {"batch": args.batch, "transport": "gRPC" if args.grpc_only else "local sockets",
                                    "steps": args.steps, "prompt_lookup": args.prompt_lookup, "rows": rows},
                  out=args.out, variant=args.variant, device=args.device)


if __name__ == "__main__":
    main()
