"""What ``specbatch up`` (and ``demo``, ``bench``, ``profile``) decide before starting the services:
the stack's options (``StackOptions``, one field a ``specbatch up`` option of
``specbatch.config.options``), the weight forms, the threads and the k policy with its profile.
Torch-free, so that it decides in a moment.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import field, make_dataclass
from pathlib import Path

from specbatch.config.options import UP, options_of
from specbatch.config.speculation import default_k_policy as coordinator_default_policy
from specbatch.kernels import cpu, forms
from specbatch.kernels.forms import Forms


def _fields():
    for option in options_of(UP):
        default = option.default_for(UP)
        yield option.dest, object, field(default=False if option.type is None else default)
    # Beyond the flags: what tests and benchmarks set on a stack of their own.
    yield "ports", object, field(default=None)  # {"coordinator", "target", "draft"}: else --port and the next two
    yield "metrics_ports", object, field(default=None)  # {"coordinator", "target", "draft"}: else --metrics
    yield "coordinator", bool, field(default=True)  # False: only the two model services (specbatch profile)
    yield "coordinator_flags", list, field(default_factory=list)  # more flags for the coordinator
    # The services also serve on Unix sockets (in a folder of the stack's own), which the
    # coordinators on this host call instead of gRPC: no gRPC threads to wake.
    yield "local_sockets", bool, field(default=True)


StackOptions = make_dataclass("StackOptions", list(_fields()))
StackOptions.__doc__ = "The options of a stack of the three services: ``specbatch up``'s flags, and a few more."


def stack_options(args, **more) -> StackOptions:
    """The options ``specbatch up``'s flags (a parsed namespace) give, and ``more``; a weight form
    this machine cannot run is refused here, before any service starts."""
    options = StackOptions(**{option.dest: getattr(args, option.dest) for option in options_of(UP)}, **more)
    pair = weight_forms(options)
    for form in (pair.target, pair.draft):
        if reason := forms.problem(form, services_device(options), options.dtype):
            raise SystemExit(reason)
    return options


def ports(options: StackOptions) -> dict:
    return options.ports or {"coordinator": options.port, "target": options.port + 1, "draft": options.port + 2}


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on ``host`` (for a process to bind in a moment)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's cpuset, taskset), which
    os.cpu_count() and torch's default thread count ignore."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_service(options: StackOptions) -> int:
    """Intra-op threads of each model service: ``--threads``, else half the cores, at least one.
    Within a step the draft computes, then the target, so the two never need the cores at once;
    with half each, neither service's OpenMP team outnumbers the cores even when another job holds
    some of them (a team larger than the cores it gets waits at every barrier for its descheduled
    threads), and each call goes wide onto every core (docs/decisions/threads.md)."""
    return options.threads or max(1, available_cores() // 2)


# libgomp's spin count for the model services where their calls go wide: a short spin bridges the
# gaps between a forward's parallel regions, then the thread sleeps, so that it does
# not spin on the core the other service computes on next (docs/decisions/wide-calls.md).
WIDE_SPINCOUNT = 10000
# Where the target computes alone (the draft hosted in its process, or no draft), no other model
# service needs the core: its helper spins on through the gaps between calls and steps (the
# coordinator's turn, the Python around a forward), tens of milliseconds, instead of sleeping and
# being woken at the next call's first region (docs/decisions/alone-spin.md).
ALONE_SPINCOUNT = 1_000_000


def no_draft(options: StackOptions) -> bool:
    return options.draft_model == "none"


def spin_count(options: StackOptions) -> int:
    """libgomp's spin count for the model services of a stack whose calls go wide: long where the
    target is the only model process, short where a draft process takes turns with it."""
    alone = no_draft(options) or draft_in_target(options)
    return ALONE_SPINCOUNT if alone else WIDE_SPINCOUNT


def draft_in_target(options: StackOptions) -> bool:
    """Whether the target's process hosts the draft (``--with-draft``): on a CPU, unless
    ``--separate-draft``. Hosted, a speculative step is one call: each Verify also drafts the next
    step (docs/decisions/draft-in-target.md). A draft cut from the target's layers
    (``--draft-layers``) keeps a process of its own, and so does a draft on a GPU, where hosting
    is not measured yet."""
    if no_draft(options) or options.separate_draft or options.draft_layers:
        return False
    return services_device(options) == "cpu" and draft_device(options) == "cpu"


def embedded_pair(options: StackOptions) -> bool:
    """Whether the stack serves the embedded target with the embedded draft (no other model, no
    layers cut, no random weights, not target alone)."""
    return not (options.target_model or options.draft_model or options.draft_layers or options.random_weights)


def services_device(options: StackOptions) -> str:
    """The model services' device: as asked, else a GPU where there is one, as the services take it."""
    if options.device is None:
        from specbatch.models.loading import default_device

        return default_device()
    return options.device


def draft_device(options: StackOptions) -> str:
    """The draft service's device: as asked ('same': the target's); else, where the target runs on a
    GPU and the host has another, that one, so that neither model's weights, caches and kernels
    share a GPU with the other's (docs/gpu.md, placement); else the target's."""
    target = services_device(options)
    if options.draft_device and options.draft_device != "same":
        return options.draft_device
    if options.draft_device is None and target.startswith("cuda"):
        import torch

        index = int(target.split(":")[1]) if ":" in target else 0
        if torch.cuda.device_count() >= 2:
            return f"cuda:{1 if index == 0 else 0}"
    return target


def weight_forms(options: StackOptions) -> Forms:
    """The target's and the draft's weight forms (``specbatch.kernels.forms``)."""
    return forms.decide(options.weights, embedded_pair(options), services_device(options), options.dtype)


def services_dtype(options: StackOptions) -> str:
    """The dtype the model services compute in on a CPU: float32 beside a kernel form, else --dtype
    (auto: bfloat16 where the CPU multiplies it natively)."""
    dtype = forms.dtype_for(weight_forms(options).target, options.dtype)
    names = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
    if dtype and dtype != "auto":
        return names.get(dtype, dtype)
    return "bfloat16" if cpu.multiplies_bf16() else "float32"


# The embedded pair's profiles, one per form the target runs on a CPU: the step times, and so the
# best k, differ by 2x and more between them (docs/decisions/k-policy-default.md).
PROFILES = Path(__file__).resolve().parents[1] / "profiles"
EMBEDDED_CPU_PROFILES = {"fp16-dot": "embedded-cpu-fp16dot.json", "bf16-dot": "embedded-cpu-bf16dot.json",
                         "q4_1": "embedded-cpu-q4_1.json", "bf16": "embedded-cpu-bf16w.json",
                         "bfloat16": "embedded-cpu.json", "float32": "embedded-cpu-fp32.json"}
# Measured with the draft hosted in the target's process (``draft_in_target``): its speculative
# steps cost less than a draft apart's. The other forms' profiles were measured with the draft apart.
# Where a form has several, each was measured on another CPU: the one measured on this CPU's model
# is taken, else the first (the coordinator then learns: it holds a profile to the CPU it serves on).
EMBEDDED_CPU_PROFILES_IN_TARGET = {"q4_1": ("embedded-cpu-q4_1-in-target.json",
                                            "embedded-cpu-q4_1-in-target-xeon.json")}
# The block kernels' AVX2 build (an AVX2-only CPU): a verify row costs more there, so speculation's
# best k is smaller. Measured with the draft in the target's process only; a draft apart learns.
EMBEDDED_CPU_PROFILES_AVX2_IN_TARGET = {"q4_1": "embedded-cpu-q4_1-avx2-in-target.json"}
# On a CPU with step times measured as served: a machine's speed drifts by 2x between spells (its
# cache shared with neighbours), and so does what a verified row costs against a step
# (docs/decisions/goodput-live.md).
EMBEDDED_CPU_POLICY = "goodput:live"
# The embedded pair on a GPU in bf16: learn, starting from its profile. Served steps there cost more
# than the profile priced, enough to lose at c = 8 (docs/decisions/k-policy-default.md): learn
# prices them as served.
EMBEDDED_GPU_PROFILE = PROFILES / "embedded-cuda-bf16.json"
EMBEDDED_GPU_POLICY = "learn"


def shipped_profile(options: StackOptions) -> tuple[str, Path] | None:
    """The shipped (policy, profile) that fits the stack, if one does: the embedded pair on a CPU
    in the form it runs, or on a GPU in bf16."""
    if not embedded_pair(options):
        return None
    device = services_device(options)
    if device.startswith("cuda") and options.dtype in (None, "auto", "bf16", "bfloat16"):
        return EMBEDDED_GPU_POLICY, EMBEDDED_GPU_PROFILE
    if device != "cpu":
        return None
    target = weight_forms(options).target
    form = services_dtype(options) if target == "model" else target
    if form in forms.BLOCK_FORMS and cpu.blocks_on_avx2():
        name = EMBEDDED_CPU_PROFILES_AVX2_IN_TARGET.get(form) if draft_in_target(options) else None
    else:
        hosted = EMBEDDED_CPU_PROFILES_IN_TARGET.get(form) if draft_in_target(options) else None
        name = measured_here(hosted) if hosted else EMBEDDED_CPU_PROFILES.get(form)
    return (EMBEDDED_CPU_POLICY, PROFILES / name) if name else None


def measured_here(names: tuple[str, ...]) -> str:
    """The first of these shipped profiles measured on this CPU's model, else the first."""
    here = cpu.model_name()
    for name in names:
        path = PROFILES / name
        if path.exists() and json.loads(path.read_text()).get("hardware", {}).get("name") == here:
            return name
    return names[0]


def default_k_policy(options: StackOptions) -> tuple[str, str | None]:
    """The k policy and profile: as asked; else, where no profile is given, the shipped profile's
    policy for the embedded pair; else the coordinator's own default."""
    if options.k_policy:
        return options.k_policy, options.profile
    shipped = shipped_profile(options) if options.profile is None else None
    if shipped is not None and shipped[1].exists():
        return shipped[0], str(shipped[1])
    return coordinator_default_policy(options.profile), options.profile
