"""What the draft and target services share: cache calls over an Engine, flags, and start-up.

The servicers are thin shells: they convert messages, hold a lock (one forward at a time on one
model) and call the engine, which runs and is tested without gRPC.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time

import numpy as np
import torch

from specbatch.engine.batch import SequenceInput
from specbatch.engine.buckets import add_cuda_graphs_flag
from specbatch.engine.engine import Engine
from specbatch.engine.sampling import SamplingParams, SparseDistribution
from specbatch.models.embedded import EMBEDDED, EMBEDDED_DRAFT
from specbatch.models.loading import ModelSpec, load_model
from specbatch.rpc.logs import LOG_FORMATS
from specbatch.rpc.metrics import DEFAULT_METRICS_PORTS, new_registry, serve_metrics
from specbatch.rpc.server import Server, configure_logging, engine_errors_to_status
from specbatch.rpc.tls import add_server_tls_flags, server_credentials_from_args
from specbatch.service.metrics import ServiceMetrics
from specbatch.v1 import model_services_pb2 as pb

log = logging.getLogger(__name__)


def features_to_bytes(features: torch.Tensor | None) -> bytes:
    """Features cross the wire as float16 little-endian rows (half the bytes of float32)."""
    if features is None:
        return b""
    return features.detach().to("cpu", torch.float16).numpy().astype("<f2", copy=False).tobytes()


def features_from_bytes(data: bytes, width: int) -> torch.Tensor | None:
    """The inverse of ``features_to_bytes``; malformed sizes are left for the engine to refuse."""
    if not data or not width:
        return None
    values = np.frombuffer(data, dtype="<f2")
    if values.size % width:
        return torch.from_numpy(values.astype(np.float32))  # wrong shape: the engine says so
    return torch.from_numpy(values.astype(np.float32).reshape(-1, width))


def sampling_from_proto(message: pb.Sampling) -> SamplingParams:
    return SamplingParams(message.temperature, message.top_p or 1.0, message.top_k, message.seed)


def distribution_to_proto(dist: SparseDistribution) -> pb.DraftDistribution:
    # float32 travels as float32: the target reads exactly the numbers the draft sampled with.
    return pb.DraftDistribution(token_ids=dist.token_ids.tolist(), probs=dist.probs.tolist())


def distribution_from_proto(message: pb.DraftDistribution) -> SparseDistribution:
    return SparseDistribution(np.array(message.token_ids, dtype=np.int64), np.array(message.probs, dtype=np.float32))


def sequence_inputs(messages, feature_size: int = 0) -> list[SequenceInput]:
    return [SequenceInput(m.seq_id, m.keep_len, list(m.tokens), features_from_bytes(m.features, feature_size))
            for m in messages]


class CacheServicer:
    """Prefill, Rollback, Release and CacheStats: the same on the draft and the target."""

    add_to_server = None  # the generated add_…Servicer_to_server, set by each service
    service_name = ""
    local_socket = ""  # the LocalServer's path, where one serves the same calls (CacheStats names it)

    def __init__(self, engine: Engine, model_name: str, metrics: ServiceMetrics | None = None):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics  # None: no metrics (tests that drive a servicer directly)

    @classmethod
    def serve_on(cls, server: Server, engine: Engine, model_name: str,
                 metrics: ServiceMetrics | None = None) -> "CacheServicer":
        servicer = cls(engine, model_name, metrics)
        server.add(cls.add_to_server, servicer, cls.service_name)
        return servicer

    def timed(self, fn, *args, **kwargs):
        """Run an engine call through ``Engine.run``; returns (result, compute seconds)."""

        def measured():
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            return result, time.perf_counter() - start

        return self.engine.run(measured)

    def observed(self, method: str, batch_size: int, fn, *args):
        """``timed``, and the call's batch size and compute time recorded under ``method``."""
        result, seconds = self.timed(fn, *args)
        if self.metrics is not None:
            self.metrics.observe_call(method, batch_size, seconds)
        return result, seconds

    @engine_errors_to_status
    def Prefill(self, request, context):
        inputs = sequence_inputs(request.sequences, self.engine.feature_size)
        lengths, _ = self.observed("Prefill", len(inputs), self.engine.prefill, inputs)
        return pb.PrefillResponse(
            sequences=[pb.SequenceLength(seq_id=i.seq_id, cached_len=n) for i, n in zip(inputs, lengths)]
        )

    @engine_errors_to_status
    def Rollback(self, request, context):
        def rollback():
            for item in request.sequences:  # check all first: a bad item changes nothing
                self.engine.check_rollback(item.seq_id, item.cached_len)
            for item in request.sequences:
                self.engine.rollback(item.seq_id, item.cached_len)

        self.timed(rollback)
        return pb.RollbackResponse()

    @engine_errors_to_status
    def Release(self, request, context):
        released, _ = self.timed(self.engine.release, list(request.seq_ids))
        return pb.ReleaseResponse(released=released)

    def CacheStats(self, request, context):
        with self.engine.lock:
            return pb.CacheStatsResponse(
                model=self.model_name,
                sequences=len(self.engine.sequences),
                cached_tokens=self.engine.cached_tokens(),
                max_sequences=self.engine.max_sequences,
                max_context=self.engine.max_context,
                vocab_size=self.engine.vocab_size,
                feature_size=self.feature_size(),
                sequences_created=self.engine.sequences_created,
                local_socket=self.local_socket,
            )

    def feature_size(self) -> int:
        return self.engine.feature_size


# A coordinator touches each of its sequences at every step (milliseconds to seconds apart) and
# releases them when done. One that dies, or stops with requests still running, leaves them here:
# after this long untouched they are reclaimed, so a lost coordinator costs memory for a while,
# never the sequence budget for good.
DEFAULT_SEQUENCE_LEASE_SECONDS = 300.0


class SequenceLeases:
    """Reclaims the sequences of an engine that no call touched for ``lease_seconds``: sweeps
    every quarter lease (at most every 30 s), on the engine's model thread, so a sweep never
    lands inside a forward. Each reclaim is logged and counted."""

    def __init__(self, engine: Engine, lease_seconds: float, metrics: ServiceMetrics | None = None):
        self.engine, self.lease_seconds, self.metrics = engine, lease_seconds, metrics
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sequence-leases", daemon=True)

    def sweep(self) -> list[str]:
        reclaimed = self.engine.run(self.engine.reclaim_idle, self.lease_seconds)
        if reclaimed:
            log.warning("reclaimed %d sequences untouched for over %.0f s (their coordinator is gone): %s",
                        len(reclaimed), self.lease_seconds, ", ".join(reclaimed[:8]) + (" …" if len(reclaimed) > 8 else ""))
            if self.metrics is not None:
                self.metrics.sequences_reclaimed.inc(len(reclaimed))
        return reclaimed

    def _run(self) -> None:
        interval = min(30.0, self.lease_seconds / 4)
        while not self.stopped.wait(interval):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - a failed sweep is retried at the next one
                log.exception("sequence lease sweep failed")

    def start(self) -> "SequenceLeases":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()


def model_service_parser(kind: str, port: int, default_model: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m {kind}_service", description=f"specbatch {kind} service")
    parser.add_argument("--model", default=default_model,
                        help=f"HF hub id, local folder, '{EMBEDDED}' or '{EMBEDDED_DRAFT}' (default {default_model})")
    parser.add_argument("--gguf-file", help="GGUF file name inside --model")
    parser.add_argument("--num-layers", type=int, help="keep only the first N decoder layers (a self-speculative draft)")
    parser.add_argument("--random-weights", action="store_true",
                        help="only --model's shape (a folder with config.json, or opt-6.7b, opt-125m, llama-3-8b, "
                             "smollm2-135m): random weights built on the device, no download")
    if kind == "target":
        parser.add_argument("--feature-layers", default="",
                            help="also return these decoder layers' outputs (0-based, e.g. 2,15) with the final "
                                 "hidden state: the fused features of a draft distilled with the same --feature-layers")
    if kind == "draft":  # a target's results must not move: int8 would make them inexact
        parser.add_argument("--int8-weights", action="store_true",
                            help="linear layers in int8 with inputs quantized per call (CPU, float32; fbgemm): "
                                 "~2x faster draft forwards, slightly different proposals, the same output")
    parser.add_argument("--bf16-weights", action="store_true",
                        help="float32 arithmetic with every linear layer's weights read as bf16 (CPU, --dtype float32, "
                             "the engine's panel kernel): half the bytes a step reads; row-exact, so a target may "
                             "run it (its output is exactly its own target-only decoding with these weights)")
    parser.add_argument("--bf16-dot", action="store_true",
                        help="as --bf16-weights, with each linear layer's input rounded to bf16 too and pairs' products "
                             "summed in float32 by AVX512_BF16's dot-product instruction: a verify step's extra "
                             "rows cost less; row-exact as well (CPUs with AVX512_BF16)")
    parser.add_argument("--fp16-dot", action="store_true",
                        help="as --bf16-dot in float16: weights and inputs rounded to float16, products summed in "
                             "float16 in runs of 32 and the runs in float32 (CPUs with AVX512_FP16, where a "
                             "verify step's extra rows cost under half what bf16 dot products' do); row-exact")
    parser.add_argument("--q4-1", action="store_true",
                        help="the decoder layers' weights in GGUF's Q4_1 blocks (CPU, --dtype float32, AVX512_BF16): "
                             "exactly the embedded GGUF's own 4-bit values, 5 bits a weight read, inputs rounded to "
                             "bf16 as with --bf16-dot, the head on bf16 dot products; row-exact")
    parser.add_argument("--kv-bf16", action="store_true",
                        help="keep the KV cache's keys and values in bf16 (the engine's own Llama forward in float32 "
                             "on its CPU kernels): half the bytes attention reads from batch 8 on, and half the "
                             "pool's memory; the model's numbers move by that rounding, speculation stays exact "
                             "against target-only decoding with the same flag")
    parser.add_argument("--device", help="cpu, cuda, cuda:1 … (default: cuda if available)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (auto: bfloat16 on GPUs and on CPUs with native bf16, else float32)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--max-sequences", type=int, default=256, help="sequences cached at once")
    parser.add_argument("--max-context", type=int, help="tokens per sequence (default: the model's)")
    parser.add_argument("--kv-cache-gb", type=float, default=8.0, help="KV cache budget in GiB (default 8)")
    add_cuda_graphs_flag(parser)
    parser.add_argument("--sequence-lease-seconds", type=float, default=DEFAULT_SEQUENCE_LEASE_SECONDS,
                        help="reclaim a sequence no call touched for this long: its coordinator is gone "
                             f"(default {DEFAULT_SEQUENCE_LEASE_SECONDS:.0f}; 0 keeps sequences until released)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="intra-op threads (torch.set_num_threads; default: OMP_NUM_THREADS, else torch's, one "
                             "per core). Where several services share cores, give each its share: "
                             "docs/operations.md#threads")
    parser.add_argument("--wide-threads", type=int, default=0, metavar="N",
                        help="threads for calls of at least --wide-from-rows rows (sequences x tokens fed), where "
                             "the layers run in one C call; the rest run on --threads (default 0: every call "
                             "on --threads). Where the service has the cores to itself during its big calls: "
                             "docs/operations.md#threads")
    parser.add_argument("--wide-from-rows", type=int, default=12, metavar="R",
                        help="the fewest rows a call runs on --wide-threads (default 12)")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--local-socket-dir", metavar="DIR",
                        help="also serve the calls on a Unix socket of this service's own in DIR, for a coordinator "
                             "on this host (specbatch/rpc/local.py: no gRPC threads to wake; owner-only, no TLS)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="text, or json: one object per line for log collectors (default text)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="bind address of the Prometheus /metrics endpoint (default loopback only)")
    # None = not given: the default port, where a clash only costs a warning (see start_service_metrics).
    parser.add_argument("--metrics-port", type=int, default=None,
                        help=f"port of /metrics; 0 turns it off (default {DEFAULT_METRICS_PORTS[kind]})")
    add_server_tls_flags(parser)
    return parser


def run_model_service(kind: str, port: int, default_model: str, add_servicer, argv=None) -> None:
    """Parse flags, load the model, serve until SIGTERM/SIGINT."""
    parser = model_service_parser(kind, port, default_model)
    args = parser.parse_args(argv)
    if args.sequence_lease_seconds < 0:
        parser.error("--sequence-lease-seconds must be 0 (no lease) or more")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be 1 or more")
    if args.wide_threads < 0 or args.wide_from_rows < 1:
        parser.error("--wide-threads must be 0 (off) or more, --wide-from-rows 1 or more")
    credentials = server_credentials_from_args(args, parser)  # bad TLS flags: refused before loading
    configure_logging(args.log_level, args.log_format)
    # /metrics first: a taken port fails before a model load of minutes, and the process's memory
    # can be watched while the model loads (the engine's gauges join once it exists).
    registry = new_registry()
    metrics_server = serve_metrics(registry, kind, args.metrics_host, args.metrics_port)
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        spec = ModelSpec(args.model, args.gguf_file, args.num_layers, args.trust_remote_code, args.random_weights)
        started = time.perf_counter()
        model = load_model(spec, args.device, args.dtype)
        if getattr(args, "feature_layers", ""):
            from specbatch.models.eagle import fuse_target_features, parse_feature_layers

            fuse_target_features(model, parse_feature_layers(args.feature_layers))
        engine = Engine(model, max_sequences=args.max_sequences, max_context=args.max_context,
                        max_cache_bytes=int(args.kv_cache_gb * 2**30), captured_steps=args.cuda_graphs,
                        int8_weights=getattr(args, "int8_weights", False), bf16_weights=args.bf16_weights,
                        bf16_dot=args.bf16_dot, fp16_dot=args.fp16_dot, q4_1=args.q4_1, kv_bf16=args.kv_bf16,
                        wide_threads=args.wide_threads, wide_from_rows=args.wide_from_rows)
        weights = (" (linear layers int8)" if engine.int8_weights else " (weights bf16)" if engine.bf16_weights
                   else " (linear layers on bf16 dot products)" if engine.bf16_dot
                   else " (linear layers on float16 products)" if engine.fp16_dot
                   else " (decoder layers in Q4_1 blocks)" if engine.q4_1 else "")
        wide = f" ({args.wide_threads} from {args.wide_from_rows} rows a call)" if args.wide_threads else ""
        log.info("%s service: loaded %s in %.1fs on %s/%s%s, keys and values %s, %d threads%s, captured steps %s",
                 kind, spec.describe(), time.perf_counter() - started, engine.device, engine.dtype, weights,
                 str(engine.pool.dtype).removeprefix("torch."), torch.get_num_threads(), wide, engine.captured_steps)
        metrics = ServiceMetrics(kind, engine, registry)
        server = Server(f"{args.host}:{args.port}", max_workers=8, credentials=credentials,
                        interceptors=[metrics.interceptor()])
        add_servicer(server, engine, spec.describe(), metrics=metrics)
        leases = SequenceLeases(engine, args.sequence_lease_seconds, metrics) if args.sequence_lease_seconds > 0 else None
        if args.local_socket_dir:  # each call's metrics as the gRPC interceptor records them
            server.serve_locally(args.local_socket_dir, kind, observe=metrics.observe_request)
        server.start()
        if leases is not None:
            leases.start()
        server.run_until_signal(on_stop=leases.stop if leases is not None else None)
    finally:
        if metrics_server is not None:
            metrics_server.stop()
