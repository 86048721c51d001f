"""``specbatch bench``: k policies compared under real gRPC streaming traffic.

Modes: no speculation (per-request k = 0), fixed k (per-request k), and the coordinator policies
``profile`` and ``goodput`` (each its own coordinator over the same target and draft services).
Traffic (specbatch/commands/bench/traffic.py): uniform concurrency levels, a time-varying trace, Poisson
arrivals at several rates. Every mode runs the same schedule with the same prompts, one mode after
another within each traffic level, so slow drift of a shared machine spreads over all modes. With
``--rounds N`` each level runs N times, the modes taking turns in an order rotated each round and
each round on its own prompts (seed + round); a row then sums the rounds (tokens over the rounds'
wall time, latencies over all their requests): a few requests a level spread by more than the
few percent between policies. So each policy is also compared with the best
fixed k round by round, with a 95 % interval over the rounds (bench_pairs.py), and ``--control``
runs k = 0 twice a round to show the smallest difference the run can resolve.

Per run: TTFT, TPOT and end-to-end latency (mean, p50, p99) as the clients saw them, output
tokens/s, acceptance, the k the coordinator used (from its Info totals: sequence-steps by k), and
the step split into draft, target and the rest (coordinator work plus RPC). Printed as markdown,
and written as a stamped result (``specbatch.commands.results``: benchmarks/results/<machine>/bench.json,
rendered into the machine's page with its plots), or with ``--out`` into that folder with the
markdown and the PNG plots."""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from pathlib import Path

from specbatch.commands import results
from specbatch.commands.bench import pairs as bench_pairs
from specbatch.commands.bench.report import Load, Mode, Run, markdown, plot, row, trace_headroom
from specbatch.commands.bench.traffic import (
    DEFAULT_TRACE,
    Trace,
    poisson_arrivals,
    prompt_order,
    run_closed_loop,
    run_open_loop,
    stream,
)
from specbatch.commands.prompts import CHAT_PROMPTS
from specbatch.rpc.client import connect, generate, make_request
from specbatch.stack.defaults import draft_device, free_port, services_device, stack_options
from specbatch.stack.processes import LocalProcesses
from specbatch.v1 import generation_pb2 as pb

CONTROL = "k=0 (control)"  # --control: k = 0 once more a round, to measure the bench's own spread


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


def mode_request(mode: Mode, prompt: str, max_new_tokens: int):
    """One request of ``mode``. A fixed k is the paper's baseline, the chain alone unless the mode
    names leaves (``--fixed-k 1+2``), whatever the coordinator's policy would verify beside it (the
    policy modes take its leaves)."""
    return make_request(prompt, max_new_tokens, chat=True, k=mode.k, ignore_eos=True,
                        leaves=None if mode.k is None else mode.leaves)


def fitted_prompts(prompts: list[str], options) -> list[str] | list[list[int]]:
    """Random-weight shapes whose vocabulary is smaller than the tokenizer's: each prompt in the
    chat template as token ids modulo the smaller of the two models' vocabularies (as the profiler
    folds them), since the coordinator would refuse ids past it. Others: as they are."""
    from specbatch.models.embedded import EMBEDDED, EMBEDDED_DRAFT
    from specbatch.models.loading import ModelSpec, chat_token_ids, load_tokenizer
    from specbatch.models.random_weights import fit_vocab, random_config, tokenizer_source

    target = options.target_model or EMBEDDED
    names = [target] + ([] if options.draft_model in (None, "none") else [options.draft_model or EMBEDDED_DRAFT])
    vocab = min(random_config(name).vocab_size for name in names)
    tokenizer = load_tokenizer(ModelSpec(tokenizer_source(target)))
    if len(tokenizer) <= vocab:
        return prompts
    return [fit_vocab(chat_token_ids(tokenizer, [{"role": "user", "content": p}]), vocab) for p in prompts]


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
            # while the others run, and a cold one serves identical decisions measurably slower.
            generate(mode.stub, make_request(prompts[0], 4, chat=True, k=mode.k))
            runs[mode.name].append(run_one(load, mode, prompts, args, round_))
    return runs


def add_bench_flags(parser) -> None:
    parser.add_argument("--address", help="benchmark a running coordinator instead of starting one")
    parser.add_argument("--policy-address", action="append", default=[], metavar="POLICY=ADDRESS",
                        help="with --address: a running coordinator serving this policy (repeatable)")
    parser.add_argument("--k", type=int, default=3, help="fixed k compared with k=0 (when --fixed-k is not given)")
    parser.add_argument("--fixed-k", help="comma-separated fixed k values to compare, e.g. 1,2,3,4,5,6; K+L verifies "
                        "L of the draft's next-best tokens beside the first of K drafts (e.g. 1+2)")
    parser.add_argument("--policies", default="", help="coordinator policies to compare: profile,goodput "
                        "(need --profile when the bench starts the stack), learn; NAME@LABEL runs policy NAME as a mode "
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
    parser.add_argument("--out", help="a folder for results.md, results.json and the plots (default: only the "
                        "result, benchmarks/results/<machine>/bench.json)")
    results.add_output_flags(parser, "bench", out=False)


def coordinator_policies(policies: list[str], policy_profiles: list[str], profile: str | None) -> dict:
    """Per mode of ``--policies``: the policy its coordinator runs (NAME of NAME@LABEL) and the
    profile it reads (its ``--policy-profile POLICY=PATH``, else ``--profile``; ``learn``, which
    would start from it, only its own: a bench's ``learn`` learns from nothing unless told)."""
    profiles = dict(entry.split("=", 1) for entry in policy_profiles)
    chosen = {}
    for mode in policies:
        policy = mode.partition("@")[0]
        chosen[mode] = (policy, profiles.get(mode, None if policy == "learn" else profile))
    return chosen


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
    profile = args.profile or (None if args.address else context.options.profile)  # the stack's shipped one
    if not args.address and any(p.partition("@")[0] in ("profile", "goodput", "goodput:live") for p in policies) \
            and not profile:
        print("the profile and goodput policies need --profile PATH (made by `specbatch profile`)")
        return 2
    with context as processes:
        # The policy the stack serves unless told otherwise: the results' headline compares it with k = 0.
        default_policy = None if args.address else processes.options.k_policy
        # Where the services ran: the draft beside the target or on a GPU of its own.
        devices = None if args.address else {"target": services_device(processes.options),
                                             "draft": draft_device(processes.options)}
        main_stub = connect(args.address or processes.address)
        addresses = {p: given.get(p) or processes.add_coordinator(policy, free_port(), profile)
                     for p, (policy, profile) in coordinator_policies(policies, args.policy_profile, profile).items()}
        modes = [Mode("k=0 (target only)", main_stub, 0)] + [Mode(fixed_name(k, leaves), main_stub, k, leaves)
                                                             for k, leaves in fixed if k]
        fixed_names = [m.name for m in modes]
        if args.control:
            modes.append(Mode(CONTROL, main_stub, 0))
        modes += [Mode(p, connect(address), None) for p, address in addresses.items()]
        info = main_stub.Info(pb.InfoRequest())
        if args.random_weights and not args.address:
            prompts = fitted_prompts(prompts, processes.options)
        print(f"target {info.target_model} | draft {info.draft_model} | modes: {', '.join(m.name for m in modes)} | "
              f"{args.max_new_tokens} new tokens per request, greedy, {args.prompts} prompts\n", flush=True)
        if info.emulated_acceptance:
            print(f"acceptance EMULATED at {info.emulated_acceptance} per position: times only, output is not the "
                  "target's\n", flush=True)
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
                # other policies run: the same-path reference, so that a policy is compared with
                # fixed decisions served the same way.
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
    payload = {"args": {k: v for k, v in vars(args).items() if k != "fn"}, "default_policy": default_policy,
               "devices": devices, "rows": rows, "comparisons": comparisons,
               # The target's --emulate-acceptance (None: off, drafts verified), as Info reports it.
               "emulated_acceptance": info.emulated_acceptance or None,
               "trace": {"name": trace.name, "segments": trace.segments} if trace else None}
    if not args.out:
        results.write("bench", payload, variant=args.variant, device=args.device)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(table + "\n")
    written = results.write("bench", payload, out=out / "results.json", variant=args.variant, device=args.device)
    images = plot(rows, out, trace)
    print(f"\nwrote {out / 'results.md'}, {written}" + "".join(f", {p}" for p in images))
    return 0
