"""What `specbatch bench` records and reports: the modes, loads and runs; each mode's runs summed into a row (tokens/s, latency and TTFT
percentiles, acceptance), the markdown table, what the uniform levels predict for the trace, and
the plots."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from specbatch.commands.bench import pairs as bench_pairs
from specbatch.commands.bench.traffic import Trace


@dataclass
class Mode:
    name: str
    stub: object
    k: int | None  # per-request k (fixed modes); None: the coordinator's own policy
    leaves: int = 0  # fixed modes: the draft's next-best tokens verified beside the first draft


@dataclass
class Load:
    kind: str  # uniform, trace, poisson
    value: float  # concurrency, trace peak, or rate: the x axis of the plots
    label: str
    trace: Trace | None = None
    arrivals: list[float] = field(default_factory=list)


@dataclass
class Run:
    """One mode's requests at one level (one round): the clients' records and the coordinator's
    Info totals before and after them."""

    records: list
    before: object
    after: object
    timeline: list[dict]

    @property
    def wall(self) -> float:
        ok = [r for r in self.records if not r.error]
        return (max(r.finished for r in ok) - min(r.sent for r in self.records)) if ok else 0.0

    def grown(self, field_name: str) -> float:
        return getattr(self.after, field_name) - getattr(self.before, field_name)

    def metric(self, traffic: str) -> float:
        """What a round compares (bench_pairs): tokens/s under uniform traffic, else mean latency."""
        ok = [r for r in self.records if not r.error]
        if not ok:
            return 0.0
        if bench_pairs.higher_is_better(traffic):
            return sum(r.tokens for r in ok) / self.wall if self.wall else 0.0
        return statistics.fmean(r.latency for r in ok)


def percentiles(values: list[float], scale: float = 1.0) -> dict:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    ordered = sorted(v * scale for v in values)

    def at(q):  # linear interpolation between closest ranks, as numpy's default
        position = q * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {"mean": statistics.fmean(ordered), "p50": at(0.5), "p99": at(0.99)}


def summarize(runs: list[Run]) -> dict:
    """One row over one or more rounds of a mode at a level."""
    records = [r for run in runs for r in run.records]
    ok = [r for r in records if not r.error]
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    wall = sum(run.wall for run in runs) if ok else float("nan")
    tokens = sum(r.tokens for r in ok)
    proposed, accepted = sum(r.proposed for r in ok), sum(r.accepted for r in ok)
    steps = max(sum(run.grown("steps") for run in runs), 1)
    step = sum(run.grown("step_seconds") for run in runs) / steps
    draft = sum(run.grown("draft_compute_seconds") for run in runs) / steps
    target = sum(run.grown("target_compute_seconds") for run in runs) / steps
    by_k = [sum(run.after.k_histogram[k] - run.before.k_histogram[k] for run in runs)
            for k in range(len(runs[0].after.k_histogram))]
    sequence_steps = sum(by_k)
    return {
        "requests": len(ok), "errors": errors, "tokens": tokens, "seconds": wall,
        "tokens_per_s": tokens / wall if ok else 0.0,
        "ttft_ms": percentiles([r.ttft for r in ok], 1000),
        "tpot_ms": percentiles([r.tpot for r in ok if r.tpot is not None], 1000),
        "latency_s": percentiles([r.latency for r in ok]),
        "acceptance": accepted / proposed if proposed else None,
        "mean_k": sum(k * n for k, n in enumerate(by_k)) / sequence_steps if sequence_steps else 0.0,
        "k_share": {k: n / sequence_steps for k, n in enumerate(by_k) if n} if sequence_steps else {},
        "tokens_per_step": tokens / max(sum(r.steps for r in ok), 1),
        "batch": sum(run.grown("sequence_steps") for run in runs) / steps,
        "step_ms": step * 1000, "draft_ms": draft * 1000, "target_ms": target * 1000,
        "other_ms": (step - draft - target) * 1000,
    }


def row(load: Load, mode: Mode, runs: list[Run]) -> dict:
    """The results table's row (the timeline plotted is the first round's; ``per_round``: each
    round's tokens/s or mean latency, to pair any two modes later)."""
    return {"traffic": load.kind, "load": load.label, "value": load.value, "mode": mode.name,
            **summarize(runs), "per_round": [run.metric(load.kind) for run in runs], "timeline": runs[0].timeline}


def _triple(stats: dict, digits: int) -> str:
    return " / ".join(f"{stats[q]:.{digits}f}" for q in ("mean", "p50", "p99"))


def markdown(rows: list[dict]) -> str:
    base = {r["load"]: r["tokens_per_s"] for r in rows if r["mode"] == "k=0 (target only)"}
    head = ("| traffic | mode | requests | tok/s | vs k=0 | TTFT ms mean / p50 / p99 | TPOT ms mean / p50 / p99 "
            "| latency s mean / p50 / p99 | acceptance | mean k | k used |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        speedup = f"{r['tokens_per_s'] / base[r['load']]:.2f}x" if base.get(r["load"]) else "–"
        acceptance = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "–"
        shares = sorted(r["k_share"].items(), key=lambda kv: -kv[1])[:3]
        used = " ".join(f"{k}:{share:.0%}" for k, share in shares)
        errors = f" ({sum(r['errors'].values())} failed)" if r["errors"] else ""
        lines.append(f"| {r['load']} | {r['mode']} | {r['requests']}{errors} | {r['tokens_per_s']:.1f} | {speedup} "
                     f"| {_triple(r['ttft_ms'], 0)} | {_triple(r['tpot_ms'], 1)} | {_triple(r['latency_s'], 2)} "
                     f"| {acceptance} | {r['mean_k']:.2f} | {used} |")
    lines += ["", "| traffic | mode | tokens/step | mean batch | step ms | draft ms | target ms | coordinator+RPC ms |",
              "|---" * 8 + "|"]
    for r in rows:
        lines.append(f"| {r['load']} | {r['mode']} | {r['tokens_per_step']:.2f} | {r['batch']:.1f} | {r['step_ms']:.1f} "
                     f"| {r['draft_ms']:.1f} | {r['target_ms']:.1f} | {r['other_ms']:.1f} |")
    return "\n".join(lines)


def trace_headroom(rows: list[dict], trace: Trace, tokens_per_request: int, fixed: list[str]) -> str:
    """What the uniform levels predict for a closed loop over ``trace`` (Trace.closed_loop_latency):
    each mode's mean latency, and an oracle's that runs the best of the ``fixed`` modes at each
    segment's concurrency: the most any k policy can gain on the trace over the best single fixed
    k, at these throughputs. Empty where the levels do not cover the trace's concurrencies."""
    by_mode: dict[str, dict[int, float]] = {}
    for r in rows:
        if r["traffic"] == "uniform":
            by_mode.setdefault(r["mode"], {})[int(r["value"])] = r["tokens_per_s"]
    needed = {c for _, c in trace.segments}
    if not fixed or any(not needed <= set(by_mode.get(m, ())) for m in fixed):
        return ""
    latency = {m: trace.closed_loop_latency(by_mode[m], tokens_per_request)
               for m in by_mode if needed <= set(by_mode[m])}
    oracle = {c: max(by_mode[m][c] for m in fixed) for c in needed}
    latency["oracle: the best fixed k of each segment"] = trace.closed_loop_latency(oracle, tokens_per_request)
    best = min(fixed, key=latency.get)
    lines = [f"Predicted from the uniform levels for a closed loop over trace {trace.name} "
             f"(mean latency; the best single fixed k is {best}):", "",
             "| mode | predicted mean latency s | under the best fixed k |", "|---|---|---|"]
    for mode, seconds in latency.items():
        lines.append(f"| {mode} | {seconds:.2f} | {1 - seconds / latency[best]:+.1%} |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path, trace: Trace | None, prefix: str = "") -> list[Path]:
    """The uniform and Poisson levels' tok/s and mean and p99 latency per mode, and the trace's
    timeline: PNGs ``out/<prefix><traffic>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for kind, xlabel in (("uniform", "concurrency"), ("poisson", "arrival rate (requests/s)")):
        chosen = [r for r in rows if r["traffic"] == kind]
        if not chosen:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for mode in modes:
            series = sorted((r["value"], r) for r in chosen if r["mode"] == mode)
            xs = [x for x, _ in series]
            axes[0].plot(xs, [r["tokens_per_s"] for _, r in series], marker="o", label=mode)
            axes[1].plot(xs, [r["latency_s"]["mean"] for _, r in series], marker="o", label=mode)
            axes[2].plot(xs, [r["latency_s"]["p99"] for _, r in series], marker="o", label=mode)
        for ax, title in zip(axes, ("output tokens/s", "mean latency (s)", "p99 latency (s)")):
            ax.set_xlabel(xlabel)
            ax.set_title(title)
            if kind == "uniform":
                ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{kind} traffic")
        fig.tight_layout()
        path = out / f"{prefix}{kind}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    chosen = [r for r in rows if r["traffic"] == "trace"]
    if chosen and trace is not None:
        fig, axes = plt.subplots(3, 1, figsize=(11, 9))
        axes[1].sharex(axes[0])  # the two timelines; the bars below have their own axis
        edges, t = [], 0.0
        for seconds, concurrency in trace.segments:
            edges += [(t, concurrency), (t + seconds, concurrency)]
            t += seconds
        axes[0].plot(*zip(*edges), color="black", linewidth=2, label="trace concurrency")
        for r in chosen:
            timeline = r["timeline"]
            axes[0].plot([p["t"] for p in timeline], [p["running"] for p in timeline], alpha=0.7, label=r["mode"])
            points = [(p["t"], p["mean_k"]) for p in timeline if p["mean_k"] is not None]
            if points:
                axes[1].plot(*zip(*points), alpha=0.8, label=r["mode"])
        axes[0].set_ylabel("requests running")
        axes[1].set_ylabel("mean k used")
        axes[0].legend(fontsize=7, ncol=3)
        axes[1].legend(fontsize=7, ncol=3)
        axes[2].bar(range(len(chosen)), [r["latency_s"]["mean"] for r in chosen],
                    tick_label=[r["mode"] for r in chosen])
        axes[2].set_ylabel("mean latency (s)")
        axes[2].tick_params(axis="x", labelsize=7)
        axes[1].set_xlabel("seconds")
        fig.suptitle(f"time-varying trace {trace.name}")
        fig.tight_layout()
        path = out / f"{prefix}trace.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
