"""One request's time through `specbatch up`, quiet and with CPU-bound jobs beside the stack, per
thread setting of the model services (docs/operations.md#threads).

For each setting of --threads (0 = torch's default; "auto" = the launcher's rule, half the cores
each) it starts the three services as processes,
sends one warm-up request, then times --repeats requests quiet, starts --busy-jobs CPU-bound
processes, times --repeats more, and stops everything. Greedy requests: the tokens must be the
same in every row.

    .venv/bin/python benchmarks/threads.py                         # embedded models, 40 tokens
    .venv/bin/python benchmarks/threads.py --threads 0,1,2,auto --busy-jobs 2 --repeats 3
    .venv/bin/python benchmarks/threads.py --tiny                  # a random tiny model: a quick check

Timings mean something only on a machine with nothing else running: the busy jobs are the only
load it should see. Writes the rows to benchmarks/results/<machine>/threads.json (or ``--out``;
with ``--tiny``, threads-tiny.json unless ``--variant`` names another).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specbatch.commands import results
from specbatch.rpc.client import connect, generate, make_request
from specbatch.stack.defaults import StackOptions, available_cores, free_port, threads_per_service
from specbatch.stack.processes import LocalProcesses

# What the busy jobs run: a pure-Python spin, or torch matrix products on torch's default team
# (another tenant's numerical job).
BUSY = {
    "spin": "while True: pass",
    "torch": "import torch\nx = torch.randn(1024, 1024)\nwhile True: x = torch.tanh(x @ x)",
}


def timed_requests(address: str, request, repeats: int) -> tuple[list[float], list[int]]:
    stub = connect(address)
    seconds, tokens = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        result = generate(stub, request, timeout=1800)
        seconds.append(time.perf_counter() - start)
        tokens = result.token_ids
    return seconds, tokens


def measure(setting: str, args, tiny_folder: str | None) -> dict:
    threads = None if setting == "auto" else int(setting)
    ports = {"coordinator": free_port(), "target": free_port(), "draft": free_port()}
    if tiny_folder:
        options = StackOptions(target_model=tiny_folder, draft_model=tiny_folder, draft_layers=2, ports=ports,
                               threads=threads)
        request = make_request([1] + [5 + i for i in range(12)], args.new_tokens, ignore_eos=True)
    else:
        options = StackOptions(ports=ports, threads=threads)
        request = make_request(args.prompt, args.new_tokens, chat=True, ignore_eos=True)
    with LocalProcesses(options) as stack:
        generate(connect(stack.address), request, timeout=1800)  # warm-up: first forwards allocate
        quiet, quiet_tokens = timed_requests(stack.address, request, args.repeats)
        jobs = [subprocess.Popen([sys.executable, "-c", BUSY[args.busy_kind]]) for _ in range(args.busy_jobs)]
        try:
            time.sleep(1.0)  # let the jobs reach their loops
            busy, busy_tokens = timed_requests(stack.address, request, args.repeats)
        finally:
            for job in jobs:
                job.kill()
                job.wait()
        return {"setting": setting, "threads": stack.threads, "quiet": statistics.median(quiet),
                "busy": statistics.median(busy), "tokens": quiet_tokens, "same": quiet_tokens == busy_tokens}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/threads.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="0,auto",
                        help="comma-separated settings of each model service's threads: 0 (torch's default), "
                             "N, or auto (the launcher's rule); default 0,auto")
    parser.add_argument("--busy-jobs", type=int, default=1, help="CPU-bound processes beside the stack (default 1)")
    parser.add_argument("--busy-kind", choices=sorted(BUSY), default="spin")
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1, help="timed requests per case; the median is shown")
    parser.add_argument("--prompt", default="Why is the sky blue?")
    parser.add_argument("--tiny", action="store_true", help="a random tiny model instead of the embedded ones")
    results.add_output_flags(parser, "threads")
    args = parser.parse_args(argv)
    # Setting 0 must see torch's own default, not a thread count this shell happens to export.
    os.environ.pop("OMP_NUM_THREADS", None)
    cores = available_cores()
    console = Console()
    console.print(f"{cores} cores available; the launcher's rule gives each model service "
                  f"{threads_per_service(StackOptions())}; {args.busy_jobs} busy job(s) ({args.busy_kind}); "
                  f"{args.new_tokens} new tokens")
    rows = []
    with tempfile.TemporaryDirectory(prefix="threads-tiny-") as folder:
        if args.tiny:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from soak import write_tiny_model

            write_tiny_model(Path(folder))
        for setting in args.threads.split(","):
            rows.append(measure(setting.strip(), args, folder if args.tiny else None))
            console.print(f"  {rows[-1]['setting']}: quiet {rows[-1]['quiet']:.2f} s, busy {rows[-1]['busy']:.2f} s")
    table = Table(title="one request, seconds (median)")
    for column in ("setting", "threads per service", "quiet s", "busy s", "busy / quiet", "same tokens"):
        table.add_column(column)
    for row in rows:
        threads = "torch default" if row["threads"] == 0 else str(row["threads"])
        table.add_row(row["setting"], threads, f"{row['quiet']:.2f}", f"{row['busy']:.2f}",
                      f"{row['busy'] / row['quiet']:.2f}", str(row["same"] and row["tokens"] == rows[0]["tokens"]))
    console.print(table)
    results.write("threads", {"cores": cores, "busy_jobs": args.busy_jobs, "busy_kind": args.busy_kind,
                              "new_tokens": args.new_tokens, "repeats": args.repeats, "tiny": args.tiny,
                              "rows": [{k: v for k, v in row.items() if k != "tokens"} for row in rows]},
                  out=args.out, variant=args.variant or ("tiny" if args.tiny else None))
    return 0 if all(row["same"] and row["tokens"] == rows[0]["tokens"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
