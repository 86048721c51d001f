"""benchmarks/soak.py's readings and report: per level and in all, what completed, what was refused
and retried, latencies, tokens/s; each service process's memory, threads and open files, and their
drift; and whether the stack was idle afterwards."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import psutil
from rich.console import Console
from rich.table import Table

from specbatch.commands.bench.report import percentiles
from specbatch.commands.bench.run import PeriodicSampler
from specbatch.rpc.tls import open_channel
from specbatch.stack.processes import LocalProcesses
from specbatch.v1 import generation_pb2 as pb
from specbatch.v1 import model_services_pb2 as mpb
from specbatch.v1 import model_services_pb2_grpc as mpb_grpc

MIB = 2**20


@dataclass
class Outcome:
    """One request as its client saw it, over all its attempts."""

    first_sent: float = 0.0  # monotonic
    ok: bool = False
    code: str = ""  # the final error's status, when not ok
    abandoned: bool = False  # refused, and the run ended before the retry was due
    tokens: int = 0
    attempts: int = 0
    refused: int = 0  # RESOURCE_EXHAUSTED answers, each followed by a retry (or the end of the run)
    unhinted: int = 0  # of those, without a retry-after-ms trailer
    latency: float = 0.0  # the successful attempt, seconds
    end_to_end: float = 0.0  # from the first attempt, waits included
    ttft: float | None = None
    finished: float = 0.0
    messages: list[str] = field(default_factory=list)  # errors' and unhinted refusals' details


def summary(concurrency, outcomes: list[Outcome], start: float, end: float) -> dict:
    """Requests, refusals and latencies of the requests first sent in [start, end); tokens/s of
    those that finished in it (whenever sent)."""
    sent = [o for o in outcomes if start <= o.first_sent < end]
    ok = [o for o in sent if o.ok]
    finished_here = [o for o in outcomes if o.ok and start <= o.finished < end]
    tokens = sum(o.tokens for o in finished_here)
    messages = Counter(m for o in sent for m in o.messages)
    return {
        "concurrency": concurrency,
        "seconds": round(end - start, 1),
        "requests": len(ok),
        "errors": dict(Counter(o.code for o in sent if not o.ok and not o.abandoned)),
        "abandoned_at_end": sum(o.abandoned for o in sent),
        "resource_exhausted": sum(o.refused for o in sent),
        "resource_exhausted_without_hint": sum(o.unhinted for o in sent),
        "refusal_messages": dict(messages.most_common(3)),
        "retries": sum(max(o.attempts - 1, 0) for o in sent),
        "tokens": tokens,
        "tokens_per_s": round(tokens / (end - start), 1),
        "latency_s": _rounded(percentiles([o.latency for o in ok])),
        "end_to_end_s": _rounded(percentiles([o.end_to_end for o in ok])),
        "ttft_s": _rounded(percentiles([o.ttft for o in ok if o.ttft is not None])),
    }


def _rounded(stats: dict) -> dict:
    return {k: round(v, 3) for k, v in stats.items()}


def process_sample(processes: LocalProcesses) -> dict:
    sample = {}
    for name, popen in processes.processes:
        try:
            p = psutil.Process(popen.pid)
            with p.oneshot():
                sample[name] = {"rss_mib": round(p.memory_info().rss / MIB, 1), "threads": p.num_threads(),
                                "open_files": p.num_fds() if hasattr(p, "num_fds") else None}
        except psutil.Error as error:
            sample[name] = {"error": str(error)}
    return sample


class Sampler(PeriodicSampler):
    """RSS of every service process every few seconds, for the peak and the curve."""

    def __init__(self, processes: LocalProcesses, every: float = 5.0):
        super().__init__(every)
        self.processes = processes

    def sample(self, elapsed: float) -> dict:
        return {"t": round(elapsed, 1), **process_sample(self.processes)}


def wait_idle(stub, services: dict[str, str], timeout: float = 60.0) -> dict:
    """After the run: wait until the coordinator has nothing running or waiting and both services
    hold no sequence; report what is left if that does not happen within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        info = stub.Info(pb.InfoRequest(), timeout=10)
        left = {"running": info.running, "waiting": info.waiting}
        for name, address in services.items():
            with open_channel(address) as channel:
                method = mpb_grpc.TargetStub if name == "target" else mpb_grpc.DraftStub
                left[f"{name}_sequences"] = method(channel).CacheStats(mpb.CacheStatsRequest(), timeout=10).sequences
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def report(result: dict, console: Console) -> None:
    table = Table(title=f"soak: {result['models']}, k policy {result['k_policy']} | {result['seconds']:.0f} s | "
                        f"max batch {result['max_batch_size']}, max queue {result['max_queue']} | "
                        f"{result['new_tokens'][0]}-{result['new_tokens'][1]} new tokens, {result['prompts']} prompts")
    for column in ("streams", "requests", "tokens/s finished", "latency p50/p99 s", "with retries p50/p99 s",
                   "TTFT p50/p99 s", "RESOURCE_EXHAUSTED (no hint)", "retries", "errors"):
        table.add_column(column, justify="left" if column == "errors" else "right")
    for row in result["levels"] + [result["total"]]:
        errors = ", ".join(f"{k} {v}" for k, v in row["errors"].items()) or "none"
        if row["abandoned_at_end"]:
            errors += f" ({row['abandoned_at_end']} refused at the end, not retried)"
        table.add_row(str(row["concurrency"]), str(row["requests"]), f"{row['tokens_per_s']:.1f}",
                      f"{row['latency_s']['p50']:.2f} / {row['latency_s']['p99']:.2f}",
                      f"{row['end_to_end_s']['p50']:.2f} / {row['end_to_end_s']['p99']:.2f}",
                      f"{row['ttft_s']['p50']:.2f} / {row['ttft_s']['p99']:.2f}",
                      f"{row['resource_exhausted']} ({row['resource_exhausted_without_hint']})",
                      str(row["retries"]), errors)
    console.print(table)
    console.print("per level: requests first sent in its window (retries included); tokens/s: tokens of the requests "
                  "that finished in it; 'all' runs to the end of the drain")
    memory = Table(title="service processes: after warm-up → end of the run")
    for column in ("process", "RSS MiB", "drift MiB", "drift %", "peak RSS MiB", "threads", "open files"):
        memory.add_column(column, justify="left" if column == "process" else "right")
    for name, row in result["processes"].items():
        if "error" in row:
            memory.add_row(name, row["error"], "", "", "", "", "")
            continue
        memory.add_row(name, f"{row['rss_start_mib']:.1f} → {row['rss_end_mib']:.1f}", f"{row['rss_drift_mib']:+.1f}",
                       f"{row['rss_drift_pct']:+.1f}", f"{row['rss_peak_mib']:.1f}",
                       f"{row['threads_start']} → {row['threads_end']}",
                       f"{row['open_files_start']} → {row['open_files_end']}")
    console.print(memory)
    for message, count in result["total"]["refusal_messages"].items():
        console.print(f"  {count} × {message}")
    console.print(f"last requests drained in {result['drain_seconds']:.1f} s; after the run: {result['left_after']} "
                  "(all zero: nothing left behind)")


def memory_drift(start: dict, end: dict, samples: list[dict]) -> dict:
    processes = {}
    for name in start:
        a, b = start[name], end.get(name, {})
        if "rss_mib" not in a or "rss_mib" not in b:
            processes[name] = {"error": a.get("error") or b.get("error") or "not sampled"}
            continue
        peak = max([s[name]["rss_mib"] for s in samples if "rss_mib" in s.get(name, {})] + [a["rss_mib"], b["rss_mib"]])
        processes[name] = {
            "rss_start_mib": a["rss_mib"], "rss_end_mib": b["rss_mib"],
            "rss_drift_mib": round(b["rss_mib"] - a["rss_mib"], 1),
            "rss_drift_pct": round(100 * (b["rss_mib"] - a["rss_mib"]) / a["rss_mib"], 1),
            "rss_peak_mib": peak, "threads_start": a["threads"], "threads_end": b["threads"],
            "open_files_start": a["open_files"], "open_files_end": b["open_files"],
        }
    return processes
