"""``specbatch bench``: target-only (k=0) beside speculative decoding through the services.

For each concurrency level, the same greedy requests run once with k=0 and once with k=K, and the
coordinator's step totals (Info) split each decode step into draft compute, target compute, and
the rest (coordinator work plus RPC).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

from .client import connect, generate, generate_all, make_request
from .launcher import LocalProcesses, stack_options
from .prompts import CHAT_PROMPTS
from .v1 import generation_pb2 as pb


def _run(stub, concurrency: int, requests: int, k: int, max_new_tokens: int) -> dict:
    before = stub.Info(pb.InfoRequest()).totals
    prompts = [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(requests)]
    start = time.perf_counter()
    results = generate_all(stub, [make_request(p, max_new_tokens, chat=True, k=k, ignore_eos=True) for p in prompts],
                           concurrency)
    wall = time.perf_counter() - start
    after = stub.Info(pb.InfoRequest()).totals
    steps = max(after.steps - before.steps, 1)
    step = (after.step_seconds - before.step_seconds) / steps
    draft = (after.draft_compute_seconds - before.draft_compute_seconds) / steps
    target = (after.target_compute_seconds - before.target_compute_seconds) / steps
    proposed = sum(r.stats.draft_tokens_proposed for r in results)
    accepted = sum(r.stats.draft_tokens_accepted for r in results)
    tokens = sum(len(r.token_ids) for r in results)
    return {
        "tokens_per_s": tokens / wall,
        "acceptance": accepted / proposed if proposed else 0.0,
        "tokens_per_step": tokens / max(sum(r.stats.steps for r in results), 1),
        "batch": (after.sequence_steps - before.sequence_steps) / steps,
        "step_ms": step * 1000, "draft_ms": draft * 1000, "target_ms": target * 1000,
        "other_ms": (step - draft - target) * 1000,
    }


def run_bench(args) -> int:
    levels = [int(c) for c in args.concurrency.split(",")]
    context = nullcontext() if args.address else LocalProcesses(stack_options(args))
    with context as processes:
        address = args.address or processes.address
        stub = connect(address)
        info = stub.Info(pb.InfoRequest())
        print(f"target {info.target_model} | draft {info.draft_model} | k={args.k} vs k=0 | "
              f"{args.max_new_tokens} new tokens per request, greedy\n", flush=True)
        generate(stub, make_request("warm up", 8, chat=True))
        header = ("| concurrency | mode | tok/s | speed-up | acceptance | tokens/step | mean batch "
                  "| step ms | draft ms | target ms | coordinator+RPC ms |")
        print(header)
        print("|---" * (header.count("|") - 1) + "|")
        for concurrency in levels:
            requests = max(args.requests, concurrency)
            base = _run(stub, concurrency, requests, 0, args.max_new_tokens)
            spec = _run(stub, concurrency, requests, args.k, args.max_new_tokens)
            for name, row in ((f"k=0 (target only)", base), (f"k={args.k}", spec)):
                print(f"| {concurrency} | {name} | {row['tokens_per_s']:.1f} | "
                      f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x | {row['acceptance']:.2f} | "
                      f"{row['tokens_per_step']:.2f} | {row['batch']:.1f} | {row['step_ms']:.1f} | "
                      f"{row['draft_ms']:.1f} | {row['target_ms']:.1f} | {row['other_ms']:.1f} |", flush=True)
    return 0
