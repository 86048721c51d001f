"""Prefilling in chunks against whole prompts, served: one stack, one coordinator per (k policy,
prefill chunk), the modes taking turns round by round (the order rotated each round), so they share
the machine's drift.

Whole prompts (``--prefill-chunk 0``, the coordinator's default) are prefilled as they are
admitted: a burst of prompts holds every running sequence's next token until all are prefilled.
With a chunk, at most that many prompt tokens are prefilled between two decode steps. Prints, per
level and mode: tokens/s, time to first token and time per output token (mean / p50 / p99) and
mean latency; then, per policy, each chunk against whole prompts, round by round (tokens/s, mean
TTFT and p99 TPOT: above 1 is better).

    .venv/bin/python benchmarks/prefill_chunk.py [--chunks 0,128,256] [--policies fixed:0,goodput]
        [--concurrency 8,32] [--requests 32] [--rounds 3] [--max-new-tokens 48]

Writes the rows and comparisons to benchmarks/results/<machine>/prefill-chunk.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import statistics
from types import SimpleNamespace

from specbatch.commands import results
from specbatch.commands.bench import pairs as bench_pairs
from specbatch.commands.bench.report import summarize
from specbatch.commands.bench.run import Load, Mode, run_rounds
from specbatch.commands.prompts import sharegpt_prompts
from specbatch.rpc.client import connect
from specbatch.stack.defaults import StackOptions, default_k_policy, free_port
from specbatch.stack.processes import LocalProcesses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", default="0,256", help="comma-separated --prefill-chunk values (0: whole prompts)")
    parser.add_argument("--policies", default="fixed:0,goodput")
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--requests", type=int, default=32, help="requests a level and round (at least its concurrency)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompt-count", type=int, default=256)
    parser.add_argument("--prompt-start", type=int, default=16000)
    parser.add_argument("--seed", type=int, default=0)
    results.add_output_flags(parser, "prefill-chunk")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    prompts = sharegpt_prompts(args.prompt_count, args.prompt_start)
    options = StackOptions()
    profile = default_k_policy(options)[1]  # the shipped profile of the form the services run here
    run_args = SimpleNamespace(requests=args.requests, seed=args.seed, max_new_tokens=args.max_new_tokens,
                               request_timeout=600.0, rounds=args.rounds)
    rows, comparisons = [], []
    with LocalProcesses(options) as processes:
        modes = []
        for policy in policies:
            for chunk in chunks:
                address = processes.add_coordinator(policy, free_port(), profile,
                                                    extra_flags=("--prefill-chunk", str(chunk)))
                modes.append(Mode(f"{policy}, chunk {chunk or 'off'}", connect(address), None))
        for c in (int(c) for c in args.concurrency.split(",")):
            load = Load("uniform", c, f"uniform c={c}")
            runs = run_rounds(load, modes, prompts, run_args)
            for mode in modes:
                row = {"load": load.label, "mode": mode.name, **summarize(runs[mode.name])}
                rows.append(row)
                print(f"  {load.label:<14} {mode.name:<24} {row['tokens_per_s']:7.1f} tok/s  TTFT ms "
                      f"{row['ttft_ms']['mean']:.0f} / {row['ttft_ms']['p50']:.0f} / {row['ttft_ms']['p99']:.0f}  "
                      f"TPOT ms {row['tpot_ms']['mean']:.1f} / {row['tpot_ms']['p50']:.1f} / "
                      f"{row['tpot_ms']['p99']:.1f}  latency {row['latency_s']['mean']:.2f} s", flush=True)
            for policy in policies:
                whole = f"{policy}, chunk off"
                for chunk in (c for c in chunks if c):
                    name = f"{policy}, chunk {chunk}"
                    pairs = {
                        "tok/s": ([r.metric("uniform") for r in runs[name]], [r.metric("uniform") for r in runs[whole]]),
                        # Lower is better for times: the whole run's over the chunked run's.
                        "TTFT mean": ([1 / statistics.fmean(x.ttft for x in r.records) for r in runs[name]],
                                      [1 / statistics.fmean(x.ttft for x in r.records) for r in runs[whole]]),
                        "TPOT p99": ([1 / summarize([r])["tpot_ms"]["p99"] for r in runs[name]],
                                     [1 / summarize([r])["tpot_ms"]["p99"] for r in runs[whole]]),
                    }
                    for metric, (mine, theirs) in pairs.items():
                        comparisons.append({"load": load.label, "mode": name, "metric": metric,
                                            **bench_pairs.paired_ratio(mine, theirs)})
    print("\n| level | mode | tok/s | TTFT ms mean / p50 / p99 | TPOT ms mean / p50 / p99 | latency s mean |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['load']} | {row['mode']} | {row['tokens_per_s']:.1f} | "
              + " / ".join(f"{row['ttft_ms'][q]:.0f}" for q in ("mean", "p50", "p99")) + " | "
              + " / ".join(f"{row['tpot_ms'][q]:.1f}" for q in ("mean", "p50", "p99"))
              + f" | {row['latency_s']['mean']:.2f} |")
    print("\nEach chunk against whole prompts, same policy, round by round (above 1: better):\n")
    print("| level | mode | metric | ratio | 95 % interval | rounds |")
    print("|---|---|---|---|---|---|")
    for c in comparisons:
        print(f"| {c['load']} | {c['mode']} | {c['metric']} | {c['ratio']:.3f} | {c['low']:.3f} – {c['high']:.3f} "
              f"| {c['rounds']} |")
    results.write("prefill-chunk", {"args": vars(args), "rows": rows, "comparisons": comparisons},
                  out=args.out, variant=args.variant)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
