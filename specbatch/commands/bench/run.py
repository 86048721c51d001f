"""``specbatch bench``: k policies compared under real gRPC streaming traffic.

Modes: no speculation (per-request k = 0), fixed k (per-request k), and the coordinator policies
``profile`` and ``goodput`` (each its own coordinator over the same target and draft services).
Traffic (specbatch/commands/bench/traffic.py): uniform concurrency levels, a time-varying trace, Poisson
arrivals at several rates. Every mode runs the same schedule with the same prompts, one mode after
another within each traffic level, so slow drift of a shared machine spreads over all modes. With
``--rounds N`` each level runs N times, the modes taking turns in an order rotated each round and
each round on its own prompts (seed + round); a row then sums the rounds (tokens over the rounds'
wall time, latencies over all their requests): six requests a level spread by ±5 % on two cores,
more than the 2 % the policy targets ask to resolve. So each policy is also compared with the best
fixed k round by round, with a 95 % interval over the rounds (bench_pairs.py), and ``--control``
runs k = 0 twice a round to show the smallest difference the run can resolve.

Per run: TTFT, TPOT and end-to-end latency (mean, p50, p99) as the clients saw them, output
tokens/s, acceptance, the k the coordinator used (from its Info totals: sequence-steps by k), and
the step split into draft, target and the rest (coordinator work plus RPC). Printed as markdown,
and written with PNG plots and the raw numbers to --out.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from specbatch.rpc.client import connect, generate, make_request
from specbatch.commands.bench import pairs as bench_pairs
from specbatch.stack.launcher import LocalProcesses, free_port, stack_options
from specbatch.commands.prompts import CHAT_PROMPTS
from specbatch.commands.bench.traffic import DEFAULT_TRACE, Trace, poisson_arrivals, prompt_order, run_closed_loop, run_open_loop, stream
from specbatch.v1 import generation_pb2 as pb


CONTROL = "k=0 (control)"  # --control: k = 0 once more a round, to measure the bench's own spread


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


class PeriodicSampler:
    """Calls ``sample(seconds since start)`` every ``every`` seconds on a thread while a ``with``
    block lasts; what it returns is appended to ``samples``."""

    def __init__(self, every: float):
        self.every = every
        self.samples: list = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def sample(self, elapsed: float):
        raise NotImplementedError

    def _run(self):
        start = time.monotonic()
        while not self.stopping.is_set():
            self.samples.append(self.sample(time.monotonic() - start))
            self.stopping.wait(self.every)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join()


class InfoSampler(PeriodicSampler):
    """Polls the coordinator's Info while a run lasts: live batch and k used over time.
    Samples: (t, running, waiting, k_histogram)."""

    def __init__(self, stub, every: float = 0.25):
        super().__init__(every)
        self.stub = stub

    def sample(self, elapsed: float) -> tuple[float, int, int, list[int]]:
        info = self.stub.Info(pb.InfoRequest())
        return elapsed, info.running, info.waiting, list(info.totals.k_histogram)

    def timeline(self) -> list[dict]:
        """Per interval: time, requests running, mean k used over the interval's sequence-steps."""
        rows = []
        for (t0, _, _, h0), (t1, running, waiting, h1) in zip(self.samples, self.samples[1:]):
            steps = [b - a for a, b in zip(h0, h1)]
            n = sum(steps)
            rows.append({"t": t1, "running": running, "waiting": waiting,
                         "mean_k": sum(k * c for k, c in enumerate(steps)) / n if n else None})
        return rows


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


def mode_request(mode: Mode, prompt: str, max_new_tokens: int):
    """One request of ``mode``. A fixed k is the paper's baseline, the chain alone unless the mode
    names leaves (``--fixed-k 1+2``), whatever the coordinator's policy would verify beside it (the
    policy modes take its leaves)."""
    return make_request(prompt, max_new_tokens, chat=True, k=mode.k, ignore_eos=True,
                        leaves=None if mode.k is None else mode.leaves)


def run_one(load: Load, mode: Mode, prompts: list[str], args, round_: int = 0) -> Run:
    count = max(args.requests, int(load.value)) if load.kind == "uniform" else len(load.arrivals) or 100_000
    order = prompt_order(count, len(prompts), args.seed + round_)

    def send(i: int):
        return stream(mode.stub, i, mode_request(mode, prompts[order[i]], args.max_new_tokens),
                      timeout=args.request_timeout)

    before = mode.stub.Info(pb.InfoRequest()).totals
    with InfoSampler(mode.stub) as sampler:
        if load.kind == "uniform":
            records = run_closed_loop(send, lambda t: int(load.value), count=count)
        elif load.kind == "trace":
            records = run_closed_loop(send, load.trace.concurrency_at, duration=load.trace.duration)
        else:
            records = run_open_loop(send, load.arrivals)
    after = mode.stub.Info(pb.InfoRequest()).totals
    return Run(records, before, after, sampler.timeline())


def run_rounds(load: Load, modes: list[Mode], prompts: list[str], args) -> dict[str, list[Run]]:
    """Each mode's ``args.rounds`` runs at one level, the modes taking turns (the order rotated
    each round), so they share any drift in the machine's speed."""
    runs: dict[str, list[Run]] = {mode.name: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode in modes[round_ % len(modes):] + modes[: round_ % len(modes)]:
            # Its coordinator's path warmed just before (untimed): a policy's coordinator sits idle
            # while the others run, and started cold it read identical decisions 3.4 % slower
            # (profile.md 6j).
            generate(mode.stub, make_request("warm up", 4, chat=True, k=mode.k))
            runs[mode.name].append(run_one(load, mode, prompts, args, round_))
    return runs


def row(load: Load, mode: Mode, runs: list[Run]) -> dict:
    """The results table's row (the timeline plotted is the first round's; ``per_round``: each
    round's tokens/s or mean latency, to pair any two modes later)."""
    return {"traffic": load.kind, "load": load.label, "value": load.value, "mode": mode.name,
            **summarize(runs), "per_round": [run.metric(load.kind) for run in runs], "timeline": runs[0].timeline}


# ---- output ---------------------------------------------------------------------------------------

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


def plot(rows: list[dict], out: Path, trace: Trace | None) -> list[Path]:
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
        path = out / f"{kind}.png"
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
        path = out / "trace.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# ---- the command ------------------------------------------------------------------------------------

def add_bench_flags(parser) -> None:
    parser.add_argument("--address", help="benchmark a running coordinator instead of starting one")
    parser.add_argument("--policy-address", action="append", default=[], metavar="POLICY=ADDRESS",
                        help="with --address: a running coordinator serving this policy (repeatable)")
    parser.add_argument("--k", type=int, default=3, help="fixed k compared with k=0 (when --fixed-k is not given)")
    parser.add_argument("--fixed-k", help="comma-separated fixed k values to compare, e.g. 1,2,3,4,5,6; K+L verifies "
                        "L of the draft's next-best tokens beside the first of K drafts (e.g. 1+2)")
    parser.add_argument("--policies", default="", help="coordinator policies to compare: profile,goodput "
                        "(need --profile when the bench starts the stack); NAME@LABEL runs policy NAME as a mode "
                        "of its own, e.g. with --policy-profile")
    parser.add_argument("--policy-profile", action="append", default=[], metavar="POLICY=PATH",
                        help="this policy's coordinator reads PATH instead of --profile (repeatable; e.g. "
                             "--policies goodput,goodput@new --policy-profile goodput@new=new.json compares two "
                             "profiles served, side by side)")
    parser.add_argument("--traffic", default="uniform", help="comma-separated: uniform, trace, poisson")
    parser.add_argument("--concurrency", default="1,8", help="uniform traffic: comma-separated concurrency levels")
    parser.add_argument("--requests", type=int, default=8, help="uniform traffic: requests per level and mode "
                        "(at least the concurrency)")
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="trace file (segments of seconds, concurrency)")
    parser.add_argument("--trace-speed", type=float, default=1.0, help="play the trace this many times faster")
    parser.add_argument("--rates", default="0.5,1,2", help="poisson traffic: comma-separated requests per second")
    parser.add_argument("--poisson-requests", type=int, default=16, help="poisson traffic: requests per rate and mode")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each level, the modes taking turns (the "
                        "order rotated, each round its own prompts); a row sums them")
    parser.add_argument("--control", action="store_true",
                        help="run k=0 twice a round (a control): its ratio to k=0 shows the smallest difference "
                             "the run resolves (with --rounds 2 and more)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", choices=("sharegpt", "chat"), default="sharegpt",
                        help="ShareGPT first user turns (from conversation --prompt-start), or the demo's chat prompts")
    parser.add_argument("--prompt-start", type=int, default=16000)
    parser.add_argument("--prompt-count", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--out", default="bench-out", help="folder for results.md, results.json and the plots")



def coordinator_policies(policies: list[str], policy_profiles: list[str], profile: str | None) -> dict:
    """Per mode of ``--policies``: the policy its coordinator runs (NAME of NAME@LABEL) and the
    profile it reads (its ``--policy-profile POLICY=PATH``, else ``--profile``)."""
    profiles = dict(entry.split("=", 1) for entry in policy_profiles)
    return {p: (p.partition("@")[0], profiles.get(p, profile)) for p in policies}


def fixed_modes(text: str | None, k: int) -> list[tuple[int, int]]:
    """``--fixed-k``'s (k, leaves) pairs: "2,1+1" -> [(2, 0), (1, 1)]."""
    pairs = [tuple(int(n) for n in (entry.split("+") + ["0"])[:2]) for entry in text.split(",")] if text else [(k, 0)]
    if any(leaves and not k for k, leaves in pairs):
        raise ValueError(f"leaves go beside a first draft: K+L needs K >= 1 (got {text!r})")
    return pairs


def fixed_name(k: int, leaves: int) -> str:
    return f"k={k}" + (f"+{leaves} leaves" if leaves else "")


def run_bench(args) -> int:
    try:
        fixed = fixed_modes(args.fixed_k, args.k)
    except ValueError as error:
        print(error)
        return 2
    policies = [p for p in args.policies.split(",") if p]
    kinds = [t for t in args.traffic.split(",") if t]
    unknown = set(kinds) - {"uniform", "trace", "poisson"}
    if unknown:
        print(f"unknown traffic {sorted(unknown)}; known: uniform, trace, poisson")
        return 2
    if args.rounds < 1:
        print("--rounds must be at least 1")
        return 2
    if args.shared_lookup:
        print("--shared-lookup: every mode and round here sends the same prompts, so a shared index would "
              "draft from their own earlier answers; benchmarks/batch1.py --shared-lookup measures it on prompts "
              "the index has not seen")
        return 2
    given = dict(entry.split("=", 1) for entry in args.policy_address)
    if args.address and set(policies) - set(given):
        print(f"with --address, give each policy's coordinator with --policy-address POLICY=ADDRESS "
              f"(missing: {sorted(set(policies) - set(given))})")
        return 2
    unknown_profiles = {entry.split("=", 1)[0] for entry in args.policy_profile} - set(policies)
    if unknown_profiles or any("=" not in entry for entry in args.policy_profile):
        print(f"--policy-profile takes POLICY=PATH for a policy in --policies (got {args.policy_profile})")
        return 2
    if not args.address and policies and not args.profile:
        print("the profile and goodput policies need --profile PATH (made by `specbatch profile`)")
        return 2
    trace = Trace.load(args.trace).scaled(args.trace_speed) if "trace" in kinds else None
    loads: list[Load] = []
    for kind in kinds:
        if kind == "uniform":
            loads += [Load("uniform", c, f"uniform c={c}") for c in (int(c) for c in args.concurrency.split(","))]
        elif kind == "trace":
            loads.append(Load("trace", trace.peak, f"trace {trace.name}", trace=trace))
        else:
            for rate in (float(r) for r in args.rates.split(",")):
                loads.append(Load("poisson", rate, f"poisson {rate:g}/s",
                                  arrivals=poisson_arrivals(rate, args.poisson_requests, args.seed)))
    if args.prompts == "chat":
        prompts = list(CHAT_PROMPTS)
    else:
        from specbatch.commands.prompts import sharegpt_prompts

        prompts = sharegpt_prompts(args.prompt_count, args.prompt_start)
    context = nullcontext() if args.address else LocalProcesses(stack_options(args))
    with context as processes:
        main_stub = connect(args.address or processes.address)
        addresses = {p: given.get(p) or processes.add_coordinator(policy, free_port(), profile)
                     for p, (policy, profile) in coordinator_policies(policies, args.policy_profile, args.profile).items()}
        modes = [Mode("k=0 (target only)", main_stub, 0)] + [Mode(fixed_name(k, leaves), main_stub, k, leaves)
                                                             for k, leaves in fixed if k]
        fixed_names = [m.name for m in modes]
        if args.control:
            modes.append(Mode(CONTROL, main_stub, 0))
        modes += [Mode(p, connect(address), None) for p, address in addresses.items()]
        info = main_stub.Info(pb.InfoRequest())
        print(f"target {info.target_model} | draft {info.draft_model} | modes: {', '.join(m.name for m in modes)} | "
              f"{args.max_new_tokens} new tokens per request, greedy, {args.prompts} prompts\n", flush=True)
        rows, comparisons = [], []
        for load in loads:
            runs = run_rounds(load, modes, prompts, args)
            for mode in modes:
                rows.append(result := row(load, mode, runs[mode.name]))
                print(f"  {load.label:<22} {mode.name:<18} {result['tokens_per_s']:7.1f} tok/s  mean latency "
                      f"{result['latency_s']['mean']:.2f} s  mean k {result['mean_k']:.2f}", flush=True)
            if args.rounds > 1 and (policies or args.control):
                per_round = {name: [run.metric(load.kind) for run in mode_runs] for name, mode_runs in runs.items()}
                comparisons += [{"load": load.label, **c} for c in bench_pairs.compare(
                    load.kind, per_round, fixed_names, policies, (CONTROL, fixed_names[0]) if args.control else None)]
                # `fixed:K` policies run fixed decisions through a coordinator of their own, as the
                # other policies run: the same-path reference (profile.md 6j: started cold, a second
                # coordinator read ~3 % under the stack's with the same decisions; warmed, 0.988-1.002).
                same_path = [p for p in policies if p.startswith("fixed:")]
                adaptive = [p for p in policies if p not in same_path]
                if same_path and adaptive:
                    comparisons += [{"load": load.label, **c}
                                    for c in bench_pairs.compare(load.kind, per_round, same_path, adaptive)]
    table = markdown(rows)
    headroom = trace_headroom(rows, trace or Trace.load(args.trace), args.max_new_tokens, fixed_names)
    if headroom:
        table += "\n\n" + headroom
    if comparisons:
        table += ("\n\nRound by round against the best fixed k (tokens/s under uniform traffic, else mean latency; "
                  "above 1: better):\n\n" + bench_pairs.markdown(comparisons))
    print("\n" + table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "fn"},
                                                  "rows": rows, "comparisons": comparisons}, indent=1, default=str))
    images = plot(rows, out, trace)
    print(f"\nwrote {out / 'results.md'}, {out / 'results.json'}" + "".join(f", {p}" for p in images))
    return 0
