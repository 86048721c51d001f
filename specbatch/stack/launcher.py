"""Starting and stopping the three services as local processes (``specbatch up``, demo, bench)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from specbatch.kernels.cpu import compiler_accepts
from specbatch.rpc.metrics import DEFAULT_METRICS_PORTS
from specbatch.rpc.server import DEFAULT_PORTS, wait_until_serving
from specbatch.stack.prefork import popen


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's cpuset, taskset), which
    os.cpu_count() and torch's default thread count ignore."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_service(cores: int) -> int:
    """Intra-op threads for each model service started on ``cores`` cores: half of them, at
    least one. Within a step the draft computes, then the target, so the two never need the
    cores at once; with half each, neither service's OpenMP team outnumbers the cores even when
    another job holds some of them. A team larger than the cores it really gets waits at every
    barrier for its descheduled threads: one 40-token request took 109.5 s with torch's default
    threads and a CPU-bound job beside, 5.6 s with one thread per service (2 cores; issue 12).
    docs/operations.md#threads."""
    return max(1, cores // 2)


# libgomp's spin count for the model services' helper threads where their calls go wide: ~0.2 ms of
# spinning bridges the few microseconds between a forward's parallel regions, then the thread
# sleeps, so it does not spin on the core the other service computes on next (the default,
# 300,000, spins for milliseconds; 100,000 read 107 tok/s at batch 1 where 10,000 read 117-121).
WIDE_SPINCOUNT = 10000


def wide_threads(options: "StackOptions", threads: int) -> int:
    """Each model service's --wide-threads: ``options.wide_threads`` where given, else every core
    this process may use where that is more than the services' ``threads`` (0: torch's default, which
    already takes them all), else 0 (off)."""
    if options.wide_threads is not None:
        return options.wide_threads
    cores = available_cores()
    return cores if threads and cores > threads else 0


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on ``host`` (for a process to bind in a moment)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class StackOptions:
    target_model: str | None = None  # default: the embedded target
    target_gguf_file: str | None = None
    draft_model: str | None = None  # default: the embedded draft
    draft_gguf_file: str | None = None
    draft_layers: int | None = None
    no_draft: bool = False
    random_weights: bool = False  # only the models' shapes (specbatch/models/random_weights.py)
    device: str | None = None
    dtype: str | None = None
    kv_cache_gb: float | None = None  # each model service's KV budget; None: the services' default
    max_context: int | None = None  # each model service's tokens per sequence; None: the model's
    cuda_graphs: str | None = None  # each model service's --cuda-graphs; None: the services' default
    k_policy: str | None = None  # None: default_k_policy
    profile: str | None = None  # the coordinator's --profile
    max_batch_size: int = 32
    coordinator: bool = True  # False: only the two model services (specbatch profile)
    host: str = "127.0.0.1"
    ports: dict = field(default_factory=lambda: dict(DEFAULT_PORTS))
    log_level: str = "WARNING"
    # Prometheus /metrics port of each service; None: no endpoint (tests run many stacks at once).
    metrics_ports: dict | None = None
    coordinator_flags: list = field(default_factory=list)  # more flags for the coordinator (--max-queue 64 …)
    # Intra-op threads of each model service: None = threads_per_service(available cores);
    # 0 = torch's own default (the environment's OMP_NUM_THREADS, else one per core).
    threads_per_service: int | None = None
    # Each model service's --wide-threads (its calls of wide_from_rows rows and more on this many
    # threads): None = every core this process may use, where that is more than threads_per_service
    # (within a step the draft computes, then the target, so a call has the cores; ``wide_threads``);
    # 0 = off.
    wide_threads: int | None = None
    # Each model service's --wide-from-rows where wide_threads is on: 1, every call. With the helper
    # threads spinning briefly between a forward's parallel regions (WIDE_SPINCOUNT) instead of
    # sleeping through each, even a one-row step gains from the idle core: on the 2-core EPYC
    # (2026-11-26) batch 1 through the services, `specbatch up`'s default, 97.0 / 98.2 -> 116.9 /
    # 118.5 tok/s in runs taking turns (from 12 rows with sleeping helpers before; docs/engine.md).
    wide_from_rows: int = 1
    # The draft service's --int8-weights; None: on for the embedded draft where the services run
    # float32 on a CPU (``draft_int8_weights``).
    draft_int8_weights: bool | None = None
    # Both services' --bf16-weights (float32 arithmetic, weights read as bf16 on the panel kernel;
    # the draft's only where it is not int8); None: on for the embedded models on an x86 CPU with
    # AVX2 where no dtype is asked for (``bf16_weights``), the services then running float32.
    bf16_weights: bool | None = None
    # With bf16 weights, both services' linear layers on bf16 dot products instead (--bf16-dot: the
    # inputs rounded to bf16 too, AVX512_BF16); None: on wherever bf16 weights are and the CPU has
    # AVX512_BF16 (``bf16_dot``).
    bf16_dot: bool | None = None
    # With bf16 weights, both services' linear layers on float16 products instead (--fp16-dot:
    # weights and inputs rounded to float16, AVX512_FP16; twice bf16 dot products' arithmetic
    # a cycle there); None: on wherever bf16 weights are, the CPU has AVX512_FP16 and --bf16-dot
    # is not asked for (``fp16_dot``).
    fp16_dot: bool | None = None
    # Both services' --kv-bf16 (keys and values kept in bf16 on the engine's CPU kernels); None:
    # on for the embedded models wherever their linear layers run on bf16 or float16 dot products
    # (``kv_bf16``).
    kv_bf16: bool | None = None
    # The target service's --q4-1: its decoder layers in the embedded GGUF's own Q4_1 blocks (5 bits a
    # weight: a one-token step 12.9 -> 6.5 ms on the 2-core EPYC, docs/engine.md), the head and the
    # draft as they would be. Off unless asked: each extra verify row costs ~1 ms more there, so
    # speculation gains less over it.
    target_q4_1: bool = False
    # The coordinator's --leaves: the most of the draft's next-best tokens verified beside its first.
    # None: POLICY_LEAVES where the k policy is goodput, which prices each leaf's verify row against
    # its live hit rate and takes leaves only where they pay; 0 under other policies, which verify
    # every leaf offered (``coordinator_leaves``).
    leaves: int | None = None
    unsure_below: float = 0.0  # the coordinator's --unsure-below
    draft_ahead: int = 0  # the coordinator's --draft-ahead: guesses at each drafted position while the target verifies
    # The coordinator's --prompt-lookup: the most tokens drafted by copying from the request's history
    # (no draft call for that step). On: at batch 1 on the Xeon it took goodput from 1.27x to 1.38x
    # target-only (docs/engine.md, "Prompt lookup"); it only looks where the policy's k > 0.
    prompt_lookup: int = 6
    # The coordinator's --shared-lookup: tokens of finished requests' texts searched where a
    # request's own history has no match. Off unless asked: a benchmark that sends the same prompts
    # again (each mode in turn, round after round) would draft from its own earlier answers.
    shared_lookup: int = 0
    # The coordinator's --prefill-chunk: the most prompt tokens prefilled between two decode steps
    # (0: each admitted prompt whole, at once).
    prefill_chunk: int = 0
    # The services also serve their calls on Unix sockets (--local-socket-dir, in a folder of the
    # stack's own), which the coordinators on this host use instead of gRPC (specbatch/rpc/local.py).
    local_sockets: bool = True


# The embedded models' profiles, one per form the services run on a CPU (``services_cpu_form``):
# float32 on bf16 dot products (the default where the panel kernel builds and the CPU has
# AVX512_BF16), float32 with bf16 weights (the default where it builds without), bf16 (``--dtype
# auto`` where the CPU multiplies it natively) or float32, each measured on this project's machines
# (docs/profile.md): the step times, and so the best k, differ by 2x and more between them.
# The adaptive policy served best on them.
PROFILES = Path(__file__).resolve().parents[1] / "profiles"
EMBEDDED_PROFILES = {"float32+fp16-dot": PROFILES / "embedded-cpu-fp16dot.json",
                     "float32+bf16-dot": PROFILES / "embedded-cpu-bf16dot.json",
                     "float32+q4_1": PROFILES / "embedded-cpu-q4_1.json",
                     "float32+bf16-weights": PROFILES / "embedded-cpu-bf16w.json",
                     "bfloat16": PROFILES / "embedded-cpu.json", "float32": PROFILES / "embedded-cpu-fp32.json"}
EMBEDDED_POLICY = "goodput"
# The embedded pair on a GPU in bf16 (the dtype ``--dtype auto`` takes there): the profile measured
# with the real weights on an H200 over the local sockets (docs/gpu.md, "The third lease"), served
# by the profile policy, the one measured there. It picks k = 3 (2 at batch 2) to batch 8 and
# k = 0 from 16: at c = 32 it served 0.97x of k = 0 where fixed:3, the default before it, served
# 0.72x; at c = 1 and 8 both chose k = 3.
EMBEDDED_GPU_PROFILE = PROFILES / "embedded-cuda-bf16.json"
EMBEDDED_GPU_POLICY = "profile"


def _cpu_flags() -> str:
    """/proc/cpuinfo's text ("" where there is none): the launcher decides without importing torch."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512_BF16 or AMX), which is where the services'
    ``--dtype auto`` picks bf16 (``specbatch.kernels.linear.onednn_bf16_available``, oneDNN's own check:
    this one reads the same CPU flags without importing torch)."""
    return any(f" {flag}" in _cpu_flags() for flag in ("avx512_bf16", "amx_bf16"))


def services_cpu_dtype(options: StackOptions) -> str:
    """The dtype the model services run on a CPU with these options."""
    names = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
    if options.dtype and options.dtype != "auto":
        return names.get(options.dtype, options.dtype)
    return "bfloat16" if cpu_multiplies_bf16() else "float32"


def panel_kernel_expected() -> bool:
    """Whether the engine's own kernels (``specbatch.kernels.build``) should build here: an x86-64 CPU with
    AVX2 and FMA, a C compiler, not switched off; read without importing torch, as ``native``
    decides it."""
    import platform
    import shutil

    flags = _cpu_flags()
    return (os.environ.get("SPECBATCH_NATIVE", "1") != "0" and platform.machine().lower() in ("x86_64", "amd64")
            and " avx2" in flags and " fma" in flags
            and any(shutil.which(name) for name in (os.environ.get("CC", "").split()[:1] or ["cc"]) + ["gcc", "clang"]))


def bf16_dot_expected() -> bool:
    """Whether the engine's bf16 dot-product multiply should build here (``native.bf16_dot_available``):
    the panel kernel and a CPU with AVX512_BF16."""
    return panel_kernel_expected() and " avx512_bf16" in _cpu_flags()


def fp16_dot_expected() -> bool:
    """Whether the engine's float16 multiply should build here (``native.fp16_dot_available``): the
    panel kernel, a CPU with AVX512_FP16, and a C compiler that knows it (gcc 12 or later)."""
    return (panel_kernel_expected() and " avx512_fp16" in _cpu_flags()
            and compiler_accepts("-mavx512fp16"))


def bf16_weights(options: StackOptions) -> bool:
    """Whether the model services read their weights as bf16 in float32 arithmetic (``--bf16-weights``):
    as asked, else for the embedded models on a CPU where the panel kernel builds and no dtype is
    asked for. There the target's step reads half the bytes and stays row-exact: on an AVX-512
    EPYC, 1 thread, one token 25.9 -> 18.0 ms, five 32.2 -> 25.4, against bf16 with oneDNN's
    kernels 28.4 and 28.9 (docs/engine.md)."""
    if options.bf16_weights is not None:
        return options.bf16_weights
    return embedded_on_cpu(options) and options.dtype in (None, "auto") and panel_kernel_expected()


def bf16_dot(options: StackOptions) -> bool:
    """Whether the model services' linear layers run on bf16 dot products (``--bf16-dot``): as asked,
    else wherever they read bf16 weights and the CPU has AVX512_BF16 (``native.bf16_dot_available``
    decides it the same way). Its arithmetic costs half as much again, so a verify step's extra
    rows nearly vanish: SmolLM2's weights, 1 thread, AVX-512 EPYC, 1 / 6 / 32 rows 12.4 / 14.3 /
    45.2 ms against 15.8 / 22.4 / 86.3 with bf16 weights in float32 (docs/engine.md)."""
    if options.bf16_dot is not None:
        return options.bf16_dot
    return bf16_weights(options) and bf16_dot_expected() and not fp16_dot(options)


def fp16_dot(options: StackOptions) -> bool:
    """Whether the model services' linear layers run on float16 products (``--fp16-dot``): as asked,
    else wherever they read bf16 weights, the CPU has AVX512_FP16 and bf16 dot products are not
    asked for. On the 2-core Xeon (1 thread) a target step of 5 new tokens costs 1.14-1.15x one
    against 1.23-1.28x on bf16 dot products, 8 x 4 tokens 65-67 ms against 125-130 (docs/engine.md)."""
    if options.fp16_dot is not None:
        return options.fp16_dot
    return bf16_weights(options) and not options.bf16_dot and fp16_dot_expected()


def weights_flag(options: StackOptions) -> list[str]:
    """Both services' flag for how they keep their linear layers (the draft's unless int8)."""
    if fp16_dot(options):
        return ["--fp16-dot"]
    return ["--bf16-dot"] if bf16_dot(options) else ["--bf16-weights"] if bf16_weights(options) else []


def kv_bf16(options: StackOptions) -> bool:
    """Whether both model services keep their keys and values in bf16 (``--kv-bf16``): as asked,
    else for the embedded models wherever their linear layers run on bf16 or float16 dot products,
    whose inputs are rounded to 16 bits already (other models may have forwards without the
    engine's attention kernel, which refuse the flag). From batch 8 on a step reads its keys and
    values from memory; on the 2-core EPYC (bf16 dot products) target-only decoding at 32 requests
    of 256 new tokens served 417 -> 481 tok/s, while greedy outputs left the float32 cache's only
    at top-2 logit gaps below 0.05 (23 of 64 held-out prompts, docs/engine.md)."""
    if options.kv_bf16 is not None:
        return options.kv_bf16
    return embedded_on_cpu(options) and (bf16_dot(options) or fp16_dot(options) or options.target_q4_1)


def services_cpu_form(options: StackOptions) -> str:
    """The form the model services run on a CPU with these options: "float32+q4_1" (the target's),
    "float32+fp16-dot", "float32+bf16-dot", "float32+bf16-weights", or a dtype."""
    if options.target_q4_1:
        return "float32+q4_1"
    if fp16_dot(options):
        return "float32+fp16-dot"
    if bf16_dot(options):
        return "float32+bf16-dot"
    return "float32+bf16-weights" if bf16_weights(options) else services_cpu_dtype(options)


def embedded_pair(options: StackOptions) -> bool:
    """Whether the stack serves the embedded target with the embedded draft (no other model, no
    layers cut, random weights or target alone)."""
    return not (options.target_model or options.draft_model or options.draft_layers or options.no_draft
                or options.random_weights)


def services_device(options: StackOptions) -> str:
    """The model services' device: as asked, else a GPU where there is one, as the services take it
    (``models.default_device``)."""
    if options.device is None:
        from specbatch.models.loading import default_device

        return default_device()
    return options.device


def embedded_on_cpu(options: StackOptions) -> bool:
    """Whether the stack serves the embedded target with the embedded draft on a CPU. With no
    --device the services take a GPU where there is one, and so does this: the CPU forms (int8,
    bf16 dot products, bf16 keys and values) refuse CUDA, and a ``specbatch up`` on a GPU host
    failed at start-up for them."""
    return embedded_pair(options) and services_device(options) == "cpu"


def embedded_on_gpu(options: StackOptions) -> bool:
    """Whether the stack serves the embedded target with the embedded draft on a GPU in bf16 (the
    dtype ``--dtype auto`` takes there)."""
    return (embedded_pair(options) and options.dtype in (None, "auto", "bf16", "bfloat16")
            and services_device(options).startswith("cuda"))


def draft_int8_weights(options: StackOptions) -> bool:
    """Whether the draft service runs its linear layers in int8 (``specbatch.kernels.linear.Int8Linear``):
    as asked, else for the embedded draft where the services run float32 on a CPU. There its
    forward is bound by reading 36 MB of weights, and int8 cut the draft's time a token by 42 % for
    1.7 % fewer tokens a step (docs/engine.md); where the services run bf16, int8 is off."""
    if options.draft_int8_weights is not None:
        return options.draft_int8_weights
    return embedded_on_cpu(options) and services_cpu_form(options).startswith("float32")


# Leaves the goodput policy may verify beside the first draft when none are asked for. At batch 1
# on the 2-core EPYC (benchmarks/batch1.py, the embedded default with prompt lookup, modes taking
# turns) they read +5 % (32 held-out prompts, 2026-11-26), +3 % (the same 32 again) and +6 % (64);
# served at c = 1 to 32 they lost no level (docs/profile.md §6m): from batch 2 a verify row costs
# enough that goodput seldom takes one.
POLICY_LEAVES = 3


def coordinator_leaves(options: StackOptions, policy: str) -> int:
    """The coordinator's --leaves: as asked, else POLICY_LEAVES under the goodput policy (either
    form), else 0."""
    if options.leaves is not None:
        return options.leaves
    return POLICY_LEAVES if policy.partition(":")[0] == "goodput" else 0


def default_k_policy(options: StackOptions) -> tuple[str, str | None]:
    """The k policy and profile when none is asked for: for the embedded target and draft on a CPU,
    the adaptive policy over the shipped profile of the dtype the services will run (where one
    was measured); on a GPU in bf16, the profile policy over the GPU's shipped profile; else a
    fixed k of 3."""
    if options.k_policy:
        return options.k_policy, options.profile
    if embedded_on_gpu(options) and EMBEDDED_GPU_PROFILE.exists():
        return EMBEDDED_GPU_POLICY, options.profile or str(EMBEDDED_GPU_PROFILE)
    shipped = EMBEDDED_PROFILES.get(services_cpu_form(options)) if embedded_on_cpu(options) else None
    if shipped is not None and shipped.exists():
        return EMBEDDED_POLICY, options.profile or str(shipped)
    return "fixed:3", options.profile


def add_stack_flags(parser) -> None:
    parser.add_argument("--target-model", help="target: HF hub id or folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--target-gguf-file")
    parser.add_argument("--draft-model", help="draft: HF hub id or folder (default: the embedded draft)")
    parser.add_argument("--draft-gguf-file")
    parser.add_argument("--draft-layers", type=int, help="keep only the draft's first N layers")
    parser.add_argument("--no-draft", action="store_true", help="run without a draft service (target-only)")
    parser.add_argument("--random-weights", action="store_true",
                        help="models of the named shapes (config folders, or opt-6.7b, opt-125m, llama-3-8b, "
                             "smollm2-135m) with random weights, no download; prompts use the embedded tokenizer "
                             "unless the folder has one")
    parser.add_argument("--device")
    parser.add_argument("--dtype")
    parser.add_argument("--kv-cache-gb", type=float, help="KV cache budget of each model service in GiB (default 8)")
    parser.add_argument("--max-context", type=int, help="tokens per sequence in each model service (default: the "
                        "model's); with CUDA graphs the pool holds --kv-cache-gb of sequences this long")
    # No choices here: the launcher stays torch-free, the services check the value.
    parser.add_argument("--cuda-graphs", help="captured steps of each model service: auto (default: on for CUDA with "
                        "the engine's own forward), on, lazy, static or off; see python -m target_service --help")
    parser.add_argument("--k-policy", help="fixed:K, profile, goodput or goodput:live (step times measured as it "
                        "serves; the last three need --profile); default: "
                        "the shipped profile's policy for the embedded models on a CPU or, in bf16, a GPU; else fixed:3")
    parser.add_argument("--profile", help="the coordinator's profile JSON (made by `specbatch profile`)")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORTS["coordinator"], help="coordinator port")
    parser.add_argument("--target-port", type=int, default=DEFAULT_PORTS["target"])
    parser.add_argument("--draft-port", type=int, default=DEFAULT_PORTS["draft"])
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--metrics", action="store_true",
                        help="serve Prometheus /metrics on loopback: coordinator 9090, target 9091, draft 9092")
    parser.add_argument("--draft-int8-weights", action=argparse.BooleanOptionalAction, default=None,
                        help="the draft's linear layers in int8 (default: on for the embedded draft where the "
                             "services run float32 on a CPU)")
    parser.add_argument("--bf16-weights", action=argparse.BooleanOptionalAction, default=None,
                        help="both services in float32 with their weights read as bf16 (the draft's where not int8; "
                             "default: on for the embedded models on an x86 CPU with AVX2 and no --dtype)")
    parser.add_argument("--bf16-dot", action=argparse.BooleanOptionalAction, default=None,
                        help="both services' linear layers on bf16 dot products, the inputs rounded to bf16 too "
                             "(float32 otherwise; the draft's where not int8; default: on wherever bf16 weights are "
                             "and the CPU has AVX512_BF16 but not AVX512_FP16)")
    parser.add_argument("--fp16-dot", action=argparse.BooleanOptionalAction, default=None,
                        help="both services' linear layers on float16 products, weights and inputs rounded to "
                             "float16 (float32 otherwise; the draft's where not int8; default: on wherever bf16 "
                             "weights are and the CPU has AVX512_FP16, unless --bf16-dot is asked for)")
    parser.add_argument("--kv-bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="both services keep their keys and values in bf16 (the engine's own forward in float32 "
                             "on its CPU kernels; default: on for the embedded models wherever their linear layers run "
                             "on bf16 or float16 dot products)")
    parser.add_argument("--q4-1", action="store_true",
                        help="the target's decoder layers in the embedded GGUF's own Q4_1 blocks (5 bits a weight, "
                             "inputs rounded to bf16; CPUs with AVX512_BF16): about half a one-token step's time, "
                             "while each extra verify row costs more than on bf16 dot products")
    parser.add_argument("--leaves", type=int, default=None, metavar="N",
                        help="the coordinator's --leaves: up to N of the draft's next-best tokens verified beside "
                             f"the first draft, where a verify row is nearly free (default: {POLICY_LEAVES} under the "
                             "goodput policy, which verifies them only where they pay; 0 under others, which "
                             "verify all N)")
    parser.add_argument("--unsure-below", type=float, default=0.0, metavar="P",
                        help="the coordinator's --unsure-below: where the draft's first token is less likely than "
                             "P, it drafts that token alone with k - 1 leaves (default 0: never)")
    parser.add_argument("--draft-ahead", type=int, default=0, metavar="N",
                        help="the coordinator's --draft-ahead: while the target verifies, the draft guesses its "
                             "verdict (N tokens at each drafted position) and drafts the next step for each guess "
                             "(default 0: off)")
    parser.add_argument("--prompt-lookup", type=int, default=StackOptions.prompt_lookup, metavar="N",
                        help="the coordinator's --prompt-lookup: where the history's last 2-4 tokens occurred "
                             "before, draft up to N of the tokens that followed them (and the step's k, twice that at batch 1), no "
                             f"draft call (default {StackOptions.prompt_lookup}; 0: off)")
    parser.add_argument("--shared-lookup", type=int, default=StackOptions.shared_lookup, metavar="TOKENS",
                        help="the coordinator's --shared-lookup: keep the last TOKENS tokens of finished requests' "
                             "texts and draft from them where a request's own history has no match (default 0: "
                             "off; see docs/operations.md before turning it on)")
    parser.add_argument("--prefill-chunk", type=int, default=StackOptions.prefill_chunk, metavar="TOKENS",
                        help="the coordinator's --prefill-chunk: the most prompt tokens prefilled between two "
                             "decode steps, a prompt split where it runs past them (default "
                             f"{StackOptions.prefill_chunk}: each admitted prompt whole)")
    parser.add_argument("--grpc-only", action="store_true",
                        help="no local sockets: the coordinators call the services through gRPC (by default the "
                             "services also serve on Unix sockets, which the coordinators on this host use: no "
                             "gRPC threads to wake, ~1 ms less a call on two cores)")
    parser.add_argument("--threads-per-service", type=int, metavar="N",
                        help="intra-op threads of the target and of the draft service (default: half the cores "
                             "this process may use, at least 1; 0: torch's own default)")
    parser.add_argument("--wide-threads", type=int, metavar="N",
                        help="each model service's --wide-threads: its calls of --wide-from-rows rows and more on "
                             "N threads (default: all the cores this process may use, where that is more than "
                             "--threads-per-service; 0: off)")
    parser.add_argument("--wide-from-rows", type=int, default=StackOptions.wide_from_rows, metavar="R",
                        help="each model service's --wide-from-rows where --wide-threads is on (default "
                             f"{StackOptions.wide_from_rows}: every call; the services' own default is 12)")


def stack_options(args) -> StackOptions:
    if args.q4_1 and args.dtype not in (None, "auto", "float32"):
        raise SystemExit(f"--q4-1 runs the target in float32 (its layers' inputs rounded to bf16): drop --dtype "
                         f"{args.dtype}")
    if args.q4_1 and args.device not in (None, "cpu"):
        raise SystemExit("--q4-1 is for the CPU: its kernel multiplies on AVX512_BF16")
    if args.q4_1 and not bf16_dot_expected():
        raise SystemExit("--q4-1 needs a CPU with AVX512_BF16 (this one lacks it)")
    return StackOptions(
        target_model=args.target_model, target_gguf_file=args.target_gguf_file, draft_model=args.draft_model,
        draft_gguf_file=args.draft_gguf_file, draft_layers=args.draft_layers, no_draft=args.no_draft,
        random_weights=args.random_weights,
        device=args.device, dtype=args.dtype, kv_cache_gb=args.kv_cache_gb, max_context=args.max_context,
        cuda_graphs=args.cuda_graphs, k_policy=args.k_policy, profile=args.profile,
        max_batch_size=args.max_batch_size,
        host=args.host, ports={"coordinator": args.port, "target": args.target_port, "draft": args.draft_port},
        log_level=args.log_level, metrics_ports=dict(DEFAULT_METRICS_PORTS) if args.metrics else None,
        threads_per_service=args.threads_per_service, wide_threads=args.wide_threads,
        wide_from_rows=args.wide_from_rows,
        draft_int8_weights=args.draft_int8_weights,
        bf16_weights=args.bf16_weights, bf16_dot=args.bf16_dot, fp16_dot=args.fp16_dot, kv_bf16=args.kv_bf16,
        target_q4_1=args.q4_1, leaves=args.leaves,
        unsure_below=args.unsure_below, draft_ahead=args.draft_ahead, prompt_lookup=args.prompt_lookup,
        shared_lookup=args.shared_lookup, prefill_chunk=args.prefill_chunk, local_sockets=not args.grpc_only,
    )


def _model_flags(model, gguf_file, layers, options: StackOptions) -> list[str]:
    flags = []
    for name, value in (("--model", model), ("--gguf-file", gguf_file), ("--num-layers", layers),
                        ("--device", options.device),
                        ("--dtype", "float32" if (weights_flag(options) or options.target_q4_1)
                         and options.dtype in (None, "auto") else options.dtype),
                        ("--kv-cache-gb", options.kv_cache_gb), ("--max-context", options.max_context),
                        ("--cuda-graphs", options.cuda_graphs)):
        if value is not None:
            flags += [name, str(value)]
    return flags + (["--random-weights"] if options.random_weights else [])


def _feature_layer_flags(draft_model: str | None) -> list[str]:
    """A draft distilled with ``--feature-layers`` (EAGLE-3 fusion) says so in its config; its target
    must return the same layers' outputs, so the target service gets the same flag."""
    config = Path(draft_model) / "config.json" if draft_model else None
    if config is None or not config.is_file():
        return []
    layers = json.loads(config.read_text()).get("feature_layers") or []
    return ["--feature-layers", ",".join(str(layer) for layer in layers)] if layers else []


class LocalProcesses:
    """The target, draft and coordinator as child processes; stopped with SIGTERM, in reverse.
    ``start_process(module, args, env)`` starts each: a fresh ``python -m`` (``prefork.popen``),
    or a fork of a process that has imported them already (``prefork.Zygote.start``: the tests)."""

    def __init__(self, options: StackOptions, start_process=popen):
        policy, profile = default_k_policy(options)
        self.options = replace(options, k_policy=policy, profile=profile)
        self.start_process = start_process
        self.processes: list[tuple[str, subprocess.Popen]] = []
        self.socket_dir: str | None = None  # the services' local sockets, while they run

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.options.ports['coordinator']}"

    @property
    def threads(self) -> int:
        """Intra-op threads of each model service; 0: torch's default."""
        chosen = self.options.threads_per_service
        return threads_per_service(available_cores()) if chosen is None else chosen

    def _spawn(self, name: str, module: str, flags: list[str]) -> None:
        service = module.removesuffix("_service")
        metrics_port = (self.options.metrics_ports or {}).get(service, 0) if name == service else 0
        args = [*flags, "--log-level", self.options.log_level, "--metrics-port", str(metrics_port)]
        env = os.environ.copy()
        if module == "coordinator":
            env["OMP_NUM_THREADS"] = "1"  # it tokenizes and schedules: no tensor math worth a team
        else:
            if self.socket_dir:
                args += ["--local-socket-dir", self.socket_dir]
            if self.threads:
                args += ["--threads", str(self.threads)]
                env["OMP_NUM_THREADS"] = str(self.threads)  # also sizes the OpenMP pool before torch starts
            wide = wide_threads(self.options, self.threads)
            if wide:
                args += ["--wide-threads", str(wide), "--wide-from-rows", str(self.options.wide_from_rows)]
                if "OMP_WAIT_POLICY" not in env:  # (one given in the environment is kept)
                    env.setdefault("GOMP_SPINCOUNT", str(WIDE_SPINCOUNT))
        self.processes.append((name, self.start_process(module, args, env)))

    def start(self, timeout: float = 600.0) -> "LocalProcesses":
        o = self.options
        host = ["--host", o.host]
        if o.local_sockets:
            self.socket_dir = tempfile.mkdtemp(prefix="specbatch-sockets-")
        if o.target_model is None:
            # The services would convert the embedded GGUF (and assemble the embedded draft) on
            # first use, each on its own; do it once, up front.
            from specbatch.models.loading import embedded_draft_folder, embedded_model_folder

            embedded_model_folder()
            if not o.no_draft and o.draft_model is None and o.draft_layers is None and not o.random_weights:
                embedded_draft_folder()
        # No draft named: the embedded draft for the embedded target (the service's default),
        # or the target's own first --draft-layers layers.
        draft_model = None if o.no_draft else o.draft_model or o.target_model
        kv_flag = ["--kv-bf16"] if kv_bf16(o) else []
        if not o.no_draft and draft_model is None and o.draft_layers:
            from specbatch.models.embedded import EMBEDDED

            draft_model = EMBEDDED
        self._spawn("target", "target_service",
                    _model_flags(o.target_model, o.target_gguf_file, None, o) + host + ["--port", str(o.ports["target"])]
                    + _feature_layer_flags(None if o.no_draft else o.draft_model)
                    + (["--q4-1"] if o.target_q4_1 else weights_flag(o)) + kv_flag)
        draft_address = "none"
        if not o.no_draft:
            self._spawn("draft", "draft_service",
                        _model_flags(draft_model, o.draft_gguf_file if o.draft_model else o.target_gguf_file,
                                     o.draft_layers, o) + host + ["--port", str(o.ports["draft"])]
                        + (["--int8-weights"] if draft_int8_weights(o) else weights_flag(o)) + kv_flag)
            draft_address = f"{o.host}:{o.ports['draft']}"
        self.draft_address = None if draft_address == "none" else draft_address
        if o.coordinator:
            self._spawn_coordinator("coordinator", o.k_policy, o.ports["coordinator"], o.profile)
        try:
            self._wait_until_serving([self.address] if o.coordinator else
                                     list(filter(None, (self.target_address, self.draft_address))), timeout)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def target_address(self) -> str:
        return f"{self.options.host}:{self.options.ports['target']}"

    def _spawn_coordinator(self, name: str, policy: str, port: int, profile: str | None,
                           extra_flags: tuple[str, ...] = ()) -> None:
        o = self.options
        flags = ["--target", self.target_address, "--draft", self.draft_address or "none", "--k-policy", policy,
                 "--max-batch-size", str(o.max_batch_size), "--port", str(port), "--host", o.host]
        if profile:
            flags += ["--profile", profile]
        if leaves := coordinator_leaves(o, policy):
            flags += ["--leaves", str(leaves)]
        if o.unsure_below:
            flags += ["--unsure-below", str(o.unsure_below)]
        if o.draft_ahead:
            flags += ["--draft-ahead", str(o.draft_ahead)]
        if o.prompt_lookup:
            flags += ["--prompt-lookup", str(o.prompt_lookup)]
        if o.shared_lookup:
            flags += ["--shared-lookup", str(o.shared_lookup)]
        if o.prefill_chunk:
            flags += ["--prefill-chunk", str(o.prefill_chunk)]
        if o.random_weights:
            from specbatch.models.embedded import EMBEDDED
            from specbatch.models.random_weights import tokenizer_source

            flags += ["--tokenizer", tokenizer_source(o.target_model or EMBEDDED)]
        elif o.target_model:
            flags += ["--tokenizer", o.target_model]
        if o.target_gguf_file and not o.random_weights:
            flags += ["--gguf-file", o.target_gguf_file]
        self._spawn(name, "coordinator", flags + list(o.coordinator_flags) + list(extra_flags))

    def add_coordinator(self, policy: str, port: int, profile: str | None = None, timeout: float = 600.0,
                        extra_flags: tuple[str, ...] = ()) -> str:
        """One more coordinator over the same target and draft (the benchmark runs one per k
        policy; ``extra_flags``, after the stack's, set it apart otherwise); stopped with the rest.
        Returns its address."""
        self._spawn_coordinator(f"coordinator ({' '.join((policy, *extra_flags))})", policy, port, profile, extra_flags)
        address = f"{self.options.host}:{port}"
        self._wait_until_serving([address], timeout)
        return address

    def _wait_until_serving(self, addresses: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for address in addresses:
            while True:
                self.check_alive()
                try:
                    wait_until_serving(address, timeout=1.0)
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise

    def check_alive(self) -> None:
        for name, process in self.processes:
            if process.poll() is not None:
                raise RuntimeError(f"the {name} service exited with code {process.returncode}")

    def stop(self, timeout: float = 15.0) -> None:
        for _, process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for name, process in reversed(self.processes):
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            self.socket_dir = None

    def __enter__(self) -> "LocalProcesses":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
