"""Starting a model service: its flags (``specbatch.config.options``), what the machine decides
(the weight form, keys and values, threads), the model, the engine, and serving until SIGTERM."""

from __future__ import annotations

import logging
import os
import time

import torch

from specbatch.config.options import WIDE_THREADS_ENV, parser_for
from specbatch.engine.engine import Engine
from specbatch.kernels import forms
from specbatch.models.embedded import EMBEDDED, EMBEDDED_DRAFT
from specbatch.models.loading import ModelSpec, default_device, load_model
from specbatch.protocol.emulation import parse_rates
from specbatch.rpc.metrics import new_registry, serve_metrics
from specbatch.rpc.server import PortUnavailable, Server, configure_logging
from specbatch.rpc.tls import server_credentials_from_args
from specbatch.service.metrics import ServiceMetrics
from specbatch.service.servicer import SequenceLeases

log = logging.getLogger(__name__)


def engine_settings(kind: str, args) -> dict:
    """What the engine is built with beyond the model: the weight form (``--weights``, auto: as
    ``specbatch.kernels.forms`` decides), keys and values in bf16 beside a 16-bit form, and wide
    calls where ``specbatch up`` says the cores are this service's while it computes
    (``WIDE_THREADS_ENV``). Threads: ``--threads``, else OMP_NUM_THREADS, else torch's own."""
    spec = ModelSpec.parse(args.model, args.num_layers, args.trust_remote_code, args.random_weights)
    device = args.device or default_device()
    embedded = spec.name in (EMBEDDED, EMBEDDED_DRAFT) and not spec.num_layers and not spec.random_weights
    form = args.weights
    if form == "auto":
        form = getattr(forms.decide("auto", embedded, device, args.dtype), kind)
    wide = int(os.environ.get(WIDE_THREADS_ENV) or 0)
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS") or 0) or None
    return {"spec": spec, "device": device, "dtype": forms.dtype_for(form, args.dtype),
            **forms.engine_options(form, device), "threads": threads,
            "wide_threads": wide if threads and wide > threads else 0}


def new_engine(model, args, settings: dict, **shared) -> Engine:
    """The engine over ``model`` with the service's flags and what ``engine_settings`` decided;
    ``shared``: the model thread and lock of an engine it shares them with."""
    return Engine(model, max_sequences=args.max_sequences, max_context=args.max_context,
                  max_cache_bytes=int(args.kv_cache_gb * 2**30), captured_steps=args.cuda_graphs,
                  weights=settings["weights"], kv_bf16=settings["kv_bf16"],
                  wide_threads=settings["wide_threads"], wide_from_rows=1, **shared)


def hosted_draft(args, settings: dict, engine: Engine) -> tuple[Engine, str] | None:
    """The target's --with-draft: the draft's engine on the target's model thread and lock (one
    forward at a time, one OpenMP team), in the form the machine decides for the pair."""
    if not getattr(args, "with_draft", None):
        return None
    spec = ModelSpec.parse(args.with_draft, None, args.trust_remote_code, args.random_weights)
    embedded = settings["spec"].name == EMBEDDED and spec.name == EMBEDDED_DRAFT and not (
        settings["spec"].num_layers or args.random_weights)
    form = forms.decide(args.weights, embedded, settings["device"], args.dtype).draft
    draft_settings = {**settings, "spec": spec, "dtype": forms.dtype_for(form, args.dtype),
                      **forms.engine_options(form, settings["device"])}
    model = load_model(spec, settings["device"], draft_settings["dtype"])
    draft = new_engine(model, args, draft_settings, model_thread=engine.model_thread, lock=engine.lock)
    log.info("target service: hosts the draft %s, weights %s", spec.describe(), draft.weights or "as loaded")
    return draft, spec.describe()


def run_model_service(kind: str, add_servicer, argv=None) -> None:
    """Parse flags, load the model, serve until SIGTERM/SIGINT."""
    parser = parser_for(kind, description=f"specbatch {kind} service")
    args = parser.parse_args(argv)
    if args.sequence_lease_seconds < 0:
        parser.error("--sequence-lease-seconds must be 0 (no lease) or more")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be 1 or more")
    try:
        settings = engine_settings(kind, args)
    except ValueError as error:
        parser.error(str(error))
    credentials = server_credentials_from_args(args, parser)  # bad TLS flags: refused before loading
    configure_logging(args.log_level, args.log_format)
    # /metrics first: a taken port fails before a model load of minutes, and the process's memory
    # can be watched while the model loads (the engine's gauges join once it exists).
    registry = new_registry()
    metrics_server = serve_metrics(registry, kind, args.metrics_host, args.metrics_port)
    try:
        if settings["threads"]:
            torch.set_num_threads(settings["threads"])
        spec = settings["spec"]
        started = time.perf_counter()
        model = load_model(spec, settings["device"], settings["dtype"])
        if getattr(args, "feature_layers", ""):
            from specbatch.models.eagle import fuse_target_features, parse_feature_layers

            fuse_target_features(model, parse_feature_layers(args.feature_layers))
        engine = new_engine(model, args, settings)
        wide = f", calls wide on {settings['wide_threads']}" if settings["wide_threads"] else ""
        log.info("%s service: loaded %s in %.1fs on %s/%s, weights %s, keys and values %s, %d threads%s, "
                 "captured steps %s", kind, spec.describe(), time.perf_counter() - started, engine.device,
                 engine.dtype, engine.weights or "as loaded", str(engine.pool.dtype).removeprefix("torch."),
                 torch.get_num_threads(), wide, engine.captured_steps)
        metrics = ServiceMetrics(kind, engine, registry)
        try:
            server = Server(f"{args.host}:{args.port}", max_workers=8, credentials=credentials,
                            interceptors=[metrics.interceptor()])
        except PortUnavailable as error:  # taken while the model loaded
            raise SystemExit(str(error)) from None
        # The target's --emulate-acceptance (checked when parsed; its servicer warns that it is on).
        emulated = getattr(args, "emulate_acceptance", None)
        extra = {"emulated_acceptance": parse_rates(emulated)} if emulated else {}
        hosted = hosted_draft(args, settings, engine)
        if hosted is not None:
            extra.update(draft=hosted[0], draft_name=hosted[1])
        add_servicer(server, engine, spec.describe(), metrics=metrics, **extra)
        leases = [SequenceLeases(e, args.sequence_lease_seconds, metrics)
                  for e in (engine, *(hosted[:1] if hosted else ())) if args.sequence_lease_seconds > 0]
        if args.local_socket_dir:  # each call's metrics as the gRPC interceptor records them
            server.serve_locally(args.local_socket_dir, kind, observe=metrics.observe_request, loop=engine.model_thread)
        server.start()
        for lease in leases:
            lease.start()
        server.run_until_signal(on_stop=lambda: [lease.stop() for lease in leases])
    finally:
        if metrics_server is not None:
            metrics_server.stop()
