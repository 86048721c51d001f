"""Every option of the three programs, declared once: its flag, default and help, and which
programs take it. The flags of ``python -m target_service``, ``python -m draft_service``,
``python -m coordinator`` and ``specbatch up`` (and ``bench``/``profile``, which start the same stack)
are derived from here (``add_options``), so are the flags ``specbatch up`` passes on to the
programs it starts (``pass_on``) and the stack's options (``specbatch.stack.defaults.StackOptions``);
tests/test_deploy.py parses the manifests' args with the same parsers. Torch-free.

A flag is for what an operator decides. What the machine can decide (the weight form, the
threads, the transport between processes on one host) the code decides; the few overrides left
say so in their help.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from specbatch.protocol.emulation import parse_rates
from specbatch.protocol.speculation import MAX_FURTHER_STEPS, MAX_K, MAX_LEAVES

TARGET, DRAFT, COORDINATOR, UP = "target", "draft", "coordinator", "up"
SERVICES = frozenset({TARGET, DRAFT})
EVERY = frozenset({TARGET, DRAFT, COORDINATOR, UP})

DEFAULT_PORTS = {COORDINATOR: 50051, TARGET: 50052, DRAFT: 50053}
DEFAULT_METRICS_PORTS = {COORDINATOR: 9090, TARGET: 9091, DRAFT: 9092}
EMBEDDED_TARGET, EMBEDDED_DRAFT = "smollm2-135m-instruct", "smollm2-135m-instruct-draft"
# The services' weight forms (specbatch.kernels.forms): auto, the model as loaded, or one of the
# CPU kernels' forms.
WEIGHT_FORMS = ("auto", "model", "bf16", "bf16-dot", "fp16-dot", "q4_1", "q8_0")
CUDA_GRAPH_MODES = ("auto", "on", "lazy", "static", "off")
K_POLICIES = "fixed:K, profile, goodput, goodput:live, learn"
# Set by ``specbatch up`` for the model services it starts, not an operator's: within a step the
# draft computes, then the target, so each service's calls may take every core (this many
# threads) while the other waits.
WIDE_THREADS_ENV = "SPECBATCH_WIDE_THREADS"
REPLICAS = ("one address, a comma-separated list of replicas, or dns:NAME:PORT to use every address a name "
            "resolves to (a Kubernetes headless Service), re-resolved every --discovery-seconds")


def emulated_acceptance(value: str) -> str:
    """--emulate-acceptance checked where it is parsed (a bad value is the parser's error), kept
    as written, so ``specbatch up`` passes it on to the target unchanged."""
    try:
        parse_rates(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


@dataclass(frozen=True)
class Option:
    flag: str
    help: str
    default: Any = None
    type: Callable | None = str  # None: a switch (store_true)
    programs: frozenset = EVERY
    group: str = "serving"
    metavar: str | None = None
    choices: tuple | None = None
    defaults: Mapping = field(default_factory=dict)  # a program's own default, where it differs

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def default_for(self, program: str):
        return self.defaults.get(program, self.default)


OPTIONS: tuple[Option, ...] = (
    # ---- models ----
    Option("--model", "the model: an HF hub id, a local folder, a .gguf file inside either (FOLDER/NAME.gguf), "
           f"'{EMBEDDED_TARGET}' or '{EMBEDDED_DRAFT}'", programs=SERVICES, group="model",
           defaults={TARGET: EMBEDDED_TARGET, DRAFT: EMBEDDED_DRAFT}),
    Option("--target-model", "the target: as --model (default: the embedded SmolLM2-135M-Instruct)",
           programs=frozenset({UP}), group="model"),
    Option("--draft-model", "the draft: as --model, or 'none' for target-only decoding (default: the embedded "
           "draft, distilled for the embedded target)", programs=frozenset({UP}), group="model"),
    Option("--num-layers", "keep only the model's first N decoder layers (a self-speculative draft)", type=int,
           programs=SERVICES, group="model", metavar="N"),
    Option("--draft-layers", "the draft is the target's first N layers", type=int, programs=frozenset({UP}),
           group="model", metavar="N"),
    Option("--separate-draft", "run the draft in a service process of its own even where it runs on the target's "
           "device (default there: the target's process hosts it, and each Verify also drafts the next step)",
           type=None, programs=frozenset({UP}), group="model"),
    Option("--random-weights", "only the models' shapes (a config folder, or opt-6.7b, opt-125m, llama-3-8b, "
           "llama-3.2-1b, llama-3-8b-eagle, smollm2-135m) with random weights built on the device: no download",
           type=None,
           programs=SERVICES | {UP}, group="model"),
    Option("--feature-layers", "also return these decoder layers' outputs (0-based, e.g. 2,15) with the final "
           "hidden state, for a draft distilled with the same --feature-layers", default="",
           programs=frozenset({TARGET}), group="model"),
    Option("--with-draft", "also host this draft (as the draft service's --model) in this process, serving its "
           "Draft service on this address, so that a Verify also drafts each sequence's next step (specbatch up does "
           "this where the draft runs on the target's device: docs/decisions/draft-in-target.md)",
           programs=frozenset({TARGET}), group="model", metavar="MODEL"),
    Option("--emulate-acceptance", "FOR TIMING ONLY, output is then not the target's: the target keeps drafts "
           "by seeded draws at these conditional rates per position instead of checking them (0.8,0.7,0.6, the "
           "last repeating; 0.7: i.i.d.), or at a profile's acceptance_by_position (a path); for random-weight "
           "pairs, which accept nothing (docs/benchmarks.md)", type=emulated_acceptance,
           programs=frozenset({TARGET, UP}), group="model", metavar="RATES|PROFILE"),
    Option("--trust-remote-code", "let transformers run the model folder's own code", type=None, programs=SERVICES,
           group="model"),
    # ---- the engine ----
    Option("--device", "cpu, cuda, cuda:1 … (default: a GPU where there is one)", programs=SERVICES | {UP},
           group="engine"),
    Option("--draft-device", "the draft service's device: 'same' (the target's), or one such as cuda:1 (default: a "
           "second GPU where the target runs on a GPU of a host that has two or more, else the target's)",
           programs=frozenset({UP}), group="engine"),
    Option("--dtype", "auto, float32, bfloat16, float16 (auto: bfloat16 on GPUs and on CPUs that multiply it "
           "natively, else float32; a CPU kernel form runs float32)", default="auto", programs=SERVICES | {UP},
           group="engine"),
    Option("--weights", "how the linear layers keep their weights: auto (the machine decides: on a CPU where the "
           "engine's kernels build, the embedded target on its GGUF's own blocks (AVX512_VNNI or AVX2), "
           "else on bf16 weights; the embedded draft in Q8_0 "
           "blocks), model (as loaded, in --dtype), bf16, bf16-dot, fp16-dot, q4_1 (the embedded GGUF's own blocks, "
           "computed as llama.cpp does) or q8_0 (8-bit blocks, as llama.cpp computes them)", default="auto",
           programs=SERVICES | {UP}, group="engine", choices=WEIGHT_FORMS),
    Option("--kv-cache-gb", "the KV pool's budget of each model service, GiB", default=8.0, type=float,
           programs=SERVICES | {UP}, group="engine"),
    Option("--max-sequences", "sequences cached at once", default=256, type=int, programs=SERVICES, group="engine"),
    Option("--max-context", "tokens per sequence (default: the model's); with CUDA graphs the pool holds "
           "--kv-cache-gb of sequences this long", type=int, programs=SERVICES | {UP}, group="engine"),
    Option("--cuda-graphs", "steps at bucketed static shapes replayed as CUDA graphs: auto (on for CUDA with the "
           "engine's own forward), on (captured at start-up), lazy (at first use), static (padded, never captured), "
           "off", default="auto", programs=SERVICES | {UP}, group="engine", choices=CUDA_GRAPH_MODES),
    Option("--threads", "intra-op threads of each model service (default: the machine decides: all the cores this "
           "process may use for a service alone, half of them each under specbatch up; a call goes wide onto every "
           "core where a service has fewer)", type=int, programs=SERVICES | {UP}, group="engine", metavar="N"),
    Option("--sequence-lease-seconds", "reclaim a sequence no call touched for this long: its coordinator is gone "
           "(0 keeps sequences until released)", default=300.0, type=float, programs=SERVICES, group="engine"),
    # ---- speculation ----
    Option("--target", f"target service replicas: {REPLICAS}", default=f"127.0.0.1:{DEFAULT_PORTS[TARGET]}",
           programs=frozenset({COORDINATOR}), group="speculation"),
    Option("--draft", f"draft service replicas ({REPLICAS}), or 'none' for target-only decoding",
           default=f"127.0.0.1:{DEFAULT_PORTS[DRAFT]}", programs=frozenset({COORDINATOR}), group="speculation"),
    Option("--discovery-seconds", "how often dns: endpoints are re-resolved", default=10.0, type=float,
           programs=frozenset({COORDINATOR}), group="speculation"),
    Option("--tokenizer", "the tokenizer: an HF hub id, a folder or a .gguf file inside one (default: the embedded "
           "target's)", default=EMBEDDED_TARGET, programs=frozenset({COORDINATOR}), group="speculation"),
    Option("--k-policy", f"how k is chosen from the live batch size: {K_POLICIES} (profile and goodput read "
           "--profile; learn measures its own while serving; default: goodput where a profile is given, else learn; a "
           "profile measured for another pair or machine is set aside for learn; specbatch up picks the shipped "
           "profile that fits the embedded models and the machine, with goodput:live on a CPU)",
           programs=frozenset({COORDINATOR, UP}), group="speculation"),
    Option("--profile", "the profile JSON made by `specbatch profile`; re-read when the file changes",
           programs=frozenset({COORDINATOR, UP}), group="speculation", metavar="PATH"),
    Option("--profile-poll-seconds", "how often the profile file is checked for changes", default=2.0, type=float,
           programs=frozenset({COORDINATOR}), group="speculation"),
    Option("--leaves", f"the most of the draft's next-best tokens verified beside its first (0 to {MAX_LEAVES}): a "
           "rejected first draft whose target token is one of them still yields two tokens (default: 3 under the "
           "goodput policies and learn, which verify them only where they pay; else 0)", type=int,
           programs=frozenset({COORDINATOR, UP}), group="speculation", metavar="N"),
    Option("--prompt-lookup", f"where the history's last 2-4 tokens occurred before in the request, draft up to N "
           f"(0 to {MAX_K}) of the tokens that followed them instead of asking the draft (0: off)", default=6,
           type=int, programs=frozenset({COORDINATOR, UP}), group="speculation", metavar="N"),
    Option("--shared-lookup", "keep the last TOKENS tokens of finished requests' texts and, where a request's own "
           "history has no match, draft from them (0: off; a request's speed then depends on what others sent: "
           "docs/operations.md)", default=0, type=int, programs=frozenset({COORDINATOR, UP}), group="speculation",
           metavar="TOKENS"),
    Option("--steps-per-call", "while no request waits for a slot, up to N decode steps in one call of a target that "
           "runs them, each step's tokens all coming back (1: a call a step; more: less time between steps at small "
           "batches; a request's tokens then arrive in runs of up to N steps, and a new one waits at most N steps to "
           f"start; 1 to {MAX_FURTHER_STEPS + 1})", default=4, type=int, programs=frozenset({COORDINATOR, UP}),
           group="speculation", metavar="N"),
    Option("--max-batch-size", "sequences stepped together", default=32, type=int,
           programs=frozenset({COORDINATOR, UP}), group="speculation"),
    Option("--prefill-chunk", "the most prompt tokens prefilled between two decode steps, so that a burst of prompts "
           "or a long one does not hold up the running batch (0: each admitted prompt whole)", default=0, type=int,
           programs=frozenset({COORDINATOR, UP}), group="speculation", metavar="TOKENS"),
    # ---- serving ----
    Option("--stream-interval", "tokens a stream sends at once: after a request's first, its tokens go out once at "
           "least N have been accepted, and at its end (1: every step's; more: less CPU beside the model a token, "
           "in burstier streams)", default=1, type=int, programs=frozenset({COORDINATOR, UP}), metavar="N"),
    Option("--max-queue", "requests waiting for a batch slot; past it, RESOURCE_EXHAUSTED with a retry hint",
           default=256, type=int, programs=frozenset({COORDINATOR})),
    Option("--max-new-tokens-limit", "the most max_new_tokens a request may ask", default=1024, type=int,
           programs=frozenset({COORDINATOR})),
    Option("--max-prompt-tokens", "the longest prompt accepted (default: what fits the context)", type=int,
           programs=frozenset({COORDINATOR})),
    Option("--timeout", "the longest target call, seconds", default=120.0, type=float,
           programs=frozenset({COORDINATOR})),
    Option("--draft-timeout", "the longest draft call, seconds: a slower draft is set aside and steps run "
           "target-only", default=10.0, type=float, programs=frozenset({COORDINATOR})),
    Option("--drain-seconds", "on SIGTERM, how long requests in flight may take to finish (specbatch up: the "
           "coordinator's; the services stop after it)", default=30.0, type=float,
           programs=frozenset({COORDINATOR, UP})),
    Option("--wait-for-services", "seconds to wait for a target (and a draft) replica to serve", default=300.0,
           type=float, programs=frozenset({COORDINATOR})),
    Option("--host", "bind address (default: loopback only)", default="127.0.0.1"),
    Option("--port", "the port (specbatch up: the coordinator's; the target and the draft take the next two)",
           type=int, defaults={**DEFAULT_PORTS, UP: DEFAULT_PORTS[COORDINATOR]}),
    Option("--local-socket-dir", "also serve the calls on an owner-only Unix socket in DIR, which a coordinator on "
           "this host uses instead of gRPC (specbatch up does this)", programs=SERVICES, metavar="DIR"),
    Option("--metrics-host", "bind address of /metrics", default="127.0.0.1", programs=SERVICES | {COORDINATOR},
           group="observability"),
    Option("--metrics-port", "port of Prometheus /metrics (default: "
           + ", ".join(f"{p} {n}" for p, n in DEFAULT_METRICS_PORTS.items()) + ", skipped if taken; 0: none)",
           type=int, programs=SERVICES | {COORDINATOR}, group="observability"),
    Option("--metrics", "serve Prometheus /metrics on loopback: " + ", ".join(
           f"{p} {n}" for p, n in DEFAULT_METRICS_PORTS.items()), type=None, programs=frozenset({UP}),
           group="observability"),
    Option("--log-level", "DEBUG, INFO, WARNING, ERROR", default="INFO", group="observability",
           defaults={UP: "WARNING"}),
    Option("--log-format", "text, or json: one object per line for log collectors", default="text",
           programs=SERVICES | {COORDINATOR}, group="observability", choices=("text", "json")),
    # ---- TLS ----
    Option("--tls-cert", "serve TLS with this certificate (chain), PEM", programs=SERVICES | {COORDINATOR},
           group="TLS (default: plaintext)", metavar="PEM"),
    Option("--tls-key", "the certificate's private key, PEM", programs=SERVICES | {COORDINATOR},
           group="TLS (default: plaintext)", metavar="PEM"),
    Option("--tls-client-ca", "mTLS: require client certificates signed by this CA (needs --tls-cert/--tls-key)",
           programs=SERVICES | {COORDINATOR}, group="TLS (default: plaintext)", metavar="PEM"),
    Option("--service-tls-ca", "call the services over TLS, trusting this CA (PEM) for their certificates",
           programs=frozenset({COORDINATOR}), group="TLS (default: plaintext)", metavar="PEM"),
    Option("--service-tls-cert", "client certificate for services that require one (mTLS); needs "
           "--service-tls-key", programs=frozenset({COORDINATOR}), group="TLS (default: plaintext)", metavar="PEM"),
    Option("--service-tls-key", "the client certificate's private key", programs=frozenset({COORDINATOR}),
           group="TLS (default: plaintext)", metavar="PEM"),
    Option("--service-tls-server-name", "the name the services' certificates carry, where it is not the host "
           "dialled (default for dns:NAME:PORT, whose replicas are dialled by IP: NAME)",
           programs=frozenset({COORDINATOR}), group="TLS (default: plaintext)", metavar="NAME"),
)
BY_DEST = {option.dest: option for option in OPTIONS}


def options_of(program: str) -> list[Option]:
    return [option for option in OPTIONS if program in option.programs]


def _add(container, option: Option, program: str) -> None:
    """``option`` as ``program`` takes it, on a parser or one of its groups."""
    default = option.default_for(program)
    if option.type is None:
        container.add_argument(option.flag, action="store_true", help=option.help)
        return
    shown = "" if default in (None, "") or option.choices else f" (default {default})"
    container.add_argument(option.flag, type=option.type, default=default, metavar=option.metavar,
                           choices=option.choices, help=option.help + shown)


def add_options(parser: argparse.ArgumentParser, program: str) -> argparse.ArgumentParser:
    """Add ``program``'s options to ``parser``, in their groups."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in options_of(program):
        if option.group not in groups:
            groups[option.group] = parser.add_argument_group(option.group)
        _add(groups[option.group], option, program)
    return parser


def add_option(parser, dest: str, program: str = UP) -> None:
    """One declared option on a parser of a tool's own (bench-engine's --cuda-graphs, say)."""
    _add(parser, BY_DEST[dest], program)


def parser_for(program: str, **kwargs) -> argparse.ArgumentParser:
    """The whole command line of ``program`` (target, draft, coordinator)."""
    prog = {TARGET: "python -m target_service", DRAFT: "python -m draft_service",
            COORDINATOR: "python -m coordinator"}.get(program, program)
    return add_options(argparse.ArgumentParser(prog=prog, **kwargs), program)


def pass_on(values: Mapping, program: str, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that give ``program`` the values of the options it shares with ``specbatch up``,
    where they differ from ``program``'s own default (``values``: up's options by dest)."""
    args = []
    for option in options_of(program):
        if UP not in option.programs or option.dest in skip or option.dest not in values:
            continue
        value = values[option.dest]
        if value is None or value is False or value == option.default_for(program):
            continue
        args += [option.flag] if option.type is None else [option.flag, str(value)]
    return args
