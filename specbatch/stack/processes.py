"""The target, draft and coordinator as local processes (``specbatch up``, demo, bench, profile):
each started with the flags ``specbatch up`` shares with it (``specbatch.config.options.pass_on``)
and what the stack decided (``specbatch.stack.defaults``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from specbatch.config.options import (
    COORDINATOR,
    DEFAULT_METRICS_PORTS,
    DRAFT,
    TARGET,
    WIDE_THREADS_ENV,
    parser_for,
    pass_on,
)
from specbatch.models.embedded import EMBEDDED, EMBEDDED_DRAFT
from specbatch.rpc.local import STACK_SOCKET_DIR_PREFIX
from specbatch.rpc.server import check_port, wait_until_serving
from specbatch.stack.defaults import (
    StackOptions,
    available_cores,
    default_k_policy,
    draft_device,
    draft_in_target,
    no_draft,
    ports,
    spin_count,
    threads_per_service,
    weight_forms,
)
from specbatch.stack.prefork import popen

# What the launcher decides for each program itself rather than passing on as given.
DECIDED = ("host", "port", "threads", "weights", "k_policy", "profile")


def _feature_layer_flags(draft_model: str | None) -> list[str]:
    """A draft distilled with ``--feature-layers`` (EAGLE-3 fusion) says so in its config; its target
    must return the same layers' outputs, so the target service gets the same flag."""
    config = Path(draft_model) / "config.json" if draft_model else None
    if config is None or not config.is_file():
        return []
    layers = json.loads(config.read_text()).get("feature_layers") or []
    return ["--feature-layers", ",".join(str(layer) for layer in layers)] if layers else []


class LocalProcesses:
    """The target, draft and coordinator as child processes; stopped with SIGTERM, the coordinators
    first (``stop``). ``start_process(module, args, env)`` starts each: a fresh ``python -m``
    (``prefork.popen``, which ties each child's life to this process), or a fork of a process that
    has imported them already (``prefork.Zygote.start``: the tests)."""

    def __init__(self, options: StackOptions, start_process=popen):
        policy, profile = default_k_policy(options)
        self.options = replace(options, k_policy=policy, profile=profile)
        self.ports = ports(self.options)
        self.forms = weight_forms(self.options)
        self.start_process = start_process
        self.processes: list[tuple[str, subprocess.Popen]] = []
        self.drains: dict[str, float] = {}  # each coordinator's --drain-seconds, by name
        self.socket_dir: str | None = None  # the services' local sockets, while they run
        self.draft_address: str | None = None

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.ports['coordinator']}"

    @property
    def target_address(self) -> str:
        return f"{self.options.host}:{self.ports['target']}"

    @property
    def threads(self) -> int:
        """Intra-op threads of each model service."""
        return threads_per_service(self.options)

    def _metrics_port(self, service: str) -> int:
        chosen = self.options.metrics_ports or (DEFAULT_METRICS_PORTS if self.options.metrics else {})
        return chosen.get(service, 0)

    def _spawn(self, name: str, module: str, flags: list[str]) -> None:
        env = os.environ.copy()
        if module == "coordinator":
            env["OMP_NUM_THREADS"] = "1"  # it tokenizes and schedules: no tensor math worth a team
        else:
            if self.socket_dir:
                flags += ["--local-socket-dir", self.socket_dir]
            flags += ["--threads", str(self.threads)]
            env["OMP_NUM_THREADS"] = str(self.threads)  # also sizes the OpenMP pool before torch starts
            # Fewer threads than cores: within a step the draft computes, then the target, so each
            # service's calls may take every core, its idle threads spinning between a forward's
            # parallel regions: briefly beside a draft process, through the gaps between calls where
            # the target computes alone (spin_count).
            cores = available_cores()
            if self.threads < cores:
                env[WIDE_THREADS_ENV] = str(cores)
                if "OMP_WAIT_POLICY" not in env:  # (one given in the environment is kept)
                    env.setdefault("GOMP_SPINCOUNT", str(spin_count(self.options)))
        self.processes.append((name, self.start_process(module, flags, env)))

    def _service_flags(self, program: str, model: str | None, layers: int | None, weights: str) -> list[str]:
        values = asdict(self.options)
        if program == DRAFT:
            values["device"] = draft_device(self.options)
        flags = ["--host", self.options.host, "--port", str(self.ports[program]), "--weights", weights,
                 "--metrics-port", str(self._metrics_port(program))]
        flags += ["--model", model] if model else []
        flags += ["--num-layers", str(layers)] if layers else []
        return flags + pass_on(values, program, skip=DECIDED)

    def start(self, timeout: float = 600.0) -> "LocalProcesses":
        o = self.options
        if o.local_sockets:
            self.socket_dir = tempfile.mkdtemp(prefix=STACK_SOCKET_DIR_PREFIX)
        if o.target_model is None and not o.random_weights:
            # The services would convert the embedded GGUF (and assemble the embedded draft) on
            # first use, each on its own; do it once, up front.
            from specbatch.models.loading import embedded_draft_folder, embedded_model_folder

            embedded_model_folder()
            if o.draft_model is None and o.draft_layers is None:
                embedded_draft_folder()
        # No draft named: the embedded draft for the embedded target (the service's default), or
        # the target's own first --draft-layers layers.
        draft_model = None if no_draft(o) else o.draft_model or o.target_model
        if not no_draft(o) and draft_model is None and o.draft_layers:
            draft_model = EMBEDDED
        hosted = ["--with-draft", draft_model or EMBEDDED_DRAFT] if draft_in_target(o) else []
        self._spawn("target", "target_service", self._service_flags(TARGET, o.target_model, None, self.forms.target)
                    + _feature_layer_flags(None if no_draft(o) else o.draft_model) + hosted)
        if hosted:  # its Draft service is on the target's address
            self.draft_address = self.target_address
        elif not no_draft(o):
            self._spawn("draft", "draft_service", self._service_flags(DRAFT, draft_model, o.draft_layers,
                                                                      self.forms.draft))
            self.draft_address = f"{o.host}:{self.ports['draft']}"
        if o.coordinator:
            self._spawn_coordinator("coordinator", o.k_policy, self.ports["coordinator"], o.profile)
        try:
            self._wait_until_serving([self.address] if o.coordinator else
                                     list(filter(None, (self.target_address, self.draft_address))), timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def check_ports(self) -> None:
        """Raise ``PortUnavailable`` for a port of the stack in use, before any model loads (each
        server refuses it anyway as it binds, which is the check that counts)."""
        for program, port in self.ports.items():
            if port and (program != "coordinator" or self.options.coordinator):
                check_port(f"{self.options.host}:{port}")

    def _spawn_coordinator(self, name: str, policy: str, port: int, profile: str | None,
                           extra_flags: tuple[str, ...] = ()) -> None:
        o = self.options
        flags = ["--target", self.target_address, "--draft", self.draft_address or "none", "--k-policy", policy,
                 "--port", str(port), "--host", o.host, "--metrics-port",
                 str(self._metrics_port("coordinator") if name == "coordinator" else 0)]
        flags += ["--profile", profile] if profile else []
        flags += pass_on(asdict(o), COORDINATOR, skip=DECIDED)
        if o.random_weights:
            from specbatch.models.random_weights import tokenizer_source

            flags += ["--tokenizer", tokenizer_source(o.target_model or EMBEDDED)]
        elif o.target_model:
            flags += ["--tokenizer", o.target_model]
        flags += list(o.coordinator_flags) + list(extra_flags)
        self.drains[name] = parser_for(COORDINATOR).parse_args(flags).drain_seconds
        self._spawn(name, "coordinator", flags)

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

    def k_policy_in_force(self) -> str | None:
        """The coordinator's k policy as it serves (``Info``): ``learn`` where it set the profile
        aside as another deployment's. None where it does not answer."""
        import grpc

        from specbatch.rpc.client import connect
        from specbatch.v1 import generation_pb2

        try:
            return connect(self.address).Info(generation_pb2.InfoRequest(), timeout=5).k_policy
        except grpc.RpcError:
            return None

    def check_alive(self) -> None:
        for name, process in self.processes:
            if process.poll() is not None:
                raise RuntimeError(f"the {name} service exited with code {process.returncode}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to the coordinators, and once they have exited, to the services. A coordinator
        drains: the requests in flight finish within its --drain-seconds, which needs the services
        serving; so it gets that long and ``timeout`` more (its last releases, its server's stop).
        A service gets ``timeout`` (its own grace is 5 s). Whatever is still running then is killed."""
        coordinators = [(name, p) for name, p in self.processes if name in self.drains]
        services = [(name, p) for name, p in self.processes if name not in self.drains]
        for group in (coordinators, services):
            for _, process in group:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout + max((self.drains.get(name, 0.0) for name, _ in group), default=0.0)
            for _, process in group:
                try:
                    process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.processes.clear()
        self.drains.clear()
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            self.socket_dir = None

    def __enter__(self) -> "LocalProcesses":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
