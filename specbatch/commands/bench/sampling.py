"""Speculative sampling beside target-only sampling: acceptance, tokens/s, and bytes between services.

    python -m specbatch.commands.bench.sampling [--temperatures 0.7,1.0] [--concurrency 1,8] [--k 3]
                                       [--draft-layers N | --draft-model DIR] [--out FILE.json]

The rows are written as a result (``specbatch.commands.results``): benchmarks/results/<machine>/sampling.json
unless ``--out`` names the file.

Starts the target and draft services as processes (as ``specbatch up`` does) and runs the
coordinator in this process, so that its service clients' byte counters (serialised message
sizes, coordinator/backends.py) can be read. For each temperature and concurrency level, the same
seeded chat requests run with per-request k=0 (target-only sampling) and k=K (speculative
sampling). Temperature 0 (greedy) can be added as a reference: its steps carry no q'.

Bytes are everything the coordinator sent to and received from each service while the row ran
(prefills included), divided by the tokens generated.
"""

from __future__ import annotations

import argparse
import copy
import time

from coordinator.app import build_coordinator
from specbatch.commands import results
from specbatch.commands.prompts import CHAT_PROMPTS
from specbatch.config.options import UP, add_options
from specbatch.config.speculation import SpeculationConfig
from specbatch.models.embedded import EMBEDDED
from specbatch.models.loading import ModelSpec, load_tokenizer
from specbatch.rpc.client import connect, generate, generate_all, make_request
from specbatch.stack.defaults import free_port, stack_options
from specbatch.stack.processes import LocalProcesses


def _snapshot(coordinator) -> dict:
    scheduler = coordinator.scheduler
    services = {"target": scheduler.services.target_replicas, "draft": scheduler.services.draft_replicas}
    return {"totals": copy.deepcopy(scheduler.totals),
            **{f"{name}_{way}": sum(getattr(r.client.traffic, f"{way}_bytes") for r in replicas.all()) if replicas else 0
               for name, replicas in services.items() for way in ("sent", "received")},
            }


def _row(coordinator, stub, requests, concurrency: int) -> dict:
    before = _snapshot(coordinator)
    start = time.perf_counter()
    results = generate_all(stub, requests, concurrency, timeout=3600)
    wall = time.perf_counter() - start
    after = _snapshot(coordinator)
    b, a = before["totals"], after["totals"]
    steps = max(a.steps - b.steps, 1)
    tokens = sum(len(r.token_ids) for r in results)
    proposed = sum(r.stats.draft_tokens_proposed for r in results)
    accepted = sum(r.stats.draft_tokens_accepted for r in results)
    moved = {key: after[key] - before[key] for key in after if key.endswith(("_sent", "_received"))}
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "acceptance": accepted / proposed if proposed else None,
        "tokens_per_step": tokens / max(sum(r.stats.steps for r in results), 1),
        "step_ms": (a.step_seconds - b.step_seconds) / steps * 1000,
        "draft_ms": (a.draft_compute_seconds - b.draft_compute_seconds) / steps * 1000,
        "target_ms": (a.target_compute_seconds - b.target_compute_seconds) / steps * 1000,
        "draft_bytes_per_token": (moved["draft_sent"] + moved["draft_received"]) / tokens,
        "target_bytes_per_token": (moved["target_sent"] + moved["target_received"]) / tokens,
        # What one drafted token weighs in the draft's reply: its id, and for sampled requests its q'.
        "draft_reply_bytes_per_drafted_token": moved["draft_received"] / proposed if proposed else None,
        **moved,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specbatch.commands.bench.sampling", description=__doc__.split("\n")[0])
    add_options(parser, UP)
    parser.add_argument("--temperatures", default="0.7,1.0", help="comma-separated; 0 adds a greedy reference")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--k", type=int, default=3, help="speculation length compared with k=0")
    parser.add_argument("--requests", type=int, default=8, help="requests per row (at least the concurrency)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    results.add_output_flags(parser, "sampling")
    args = parser.parse_args(argv)

    options = stack_options(args)
    options.coordinator = False
    options.ports = {"coordinator": 0, "target": free_port(), "draft": free_port()}
    temperatures = [float(t) for t in args.temperatures.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    with LocalProcesses(options) as services:
        tokenizer = load_tokenizer(ModelSpec.parse(args.target_model or EMBEDDED))
        coordinator = build_coordinator(services.target_address, services.draft_address, tokenizer,
                                        speculation=SpeculationConfig(k_policy=f"fixed:{args.k}", prompt_lookup=0),
                                        max_batch_size=args.max_batch_size, eos_token_ids=frozenset())
        try:
            stub = connect(f"127.0.0.1:{coordinator.port}")
            info = f"target {args.target_model or EMBEDDED} | draft {coordinator_draft(args)} | k={args.k} vs k=0"
            print(f"{info} | {args.max_new_tokens} new tokens per request, top_p={args.top_p}, top_k={args.top_k}\n",
                  flush=True)
            generate(stub, make_request("warm up", 8, chat=True, temperature=1.0, k=args.k))
            header = ("| T | concurrency | mode | tok/s | speed-up | acceptance | tokens/step | step ms | draft ms "
                      "| target ms | draft↔coord B/token | coord↔target B/token | Propose reply B/drafted token |")
            print(header)
            print("|---" * (header.count("|") - 1) + "|", flush=True)
            for temperature in temperatures:
                for concurrency in levels:
                    count = max(args.requests, concurrency)
                    base = None
                    for k in (0, args.k):
                        requests = [make_request(CHAT_PROMPTS[i % len(CHAT_PROMPTS)], args.max_new_tokens, chat=True,
                                                 temperature=temperature, top_p=args.top_p, top_k=args.top_k,
                                                 seed=1000 + i, k=k, ignore_eos=True) for i in range(count)]
                        row = _row(coordinator, stub, requests, concurrency)
                        row.update(temperature=temperature, concurrency=concurrency, k=k)
                        base = base or row
                        rows.append(row)
                        acceptance = "–" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
                        print(f"| {temperature:g} | {concurrency} | {'target only' if k == 0 else f'k={k}'} | "
                              f"{row['tokens_per_s']:.1f} | {row['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
                              f"{acceptance} | {row['tokens_per_step']:.2f} | {row['step_ms']:.0f} | "
                              f"{row['draft_ms']:.0f} | {row['target_ms']:.0f} | {row['draft_bytes_per_token']:.0f} | "
                              f"{row['target_bytes_per_token']:.0f} | "
                              f"{row['draft_reply_bytes_per_drafted_token'] or 0:.0f} |", flush=True)
        finally:
            coordinator.stop(grace=1)
    results.write("sampling", {"k": args.k, "top_p": args.top_p, "top_k": args.top_k,
                               "max_new_tokens": args.max_new_tokens, "draft": coordinator_draft(args), "rows": rows},
                  out=args.out, variant=args.variant, device=args.device)
    return 0


def coordinator_draft(args) -> str:
    if args.draft_model == "none":
        return "none"
    if args.draft_model:
        return args.draft_model
    if args.draft_layers:
        return f"the target's first {args.draft_layers} layers"
    return "the embedded draft"


if __name__ == "__main__":
    raise SystemExit(main())
