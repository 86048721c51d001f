"""Assembling a coordinator: connect to the services, learn their limits, serve the client API."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from specbatch.config.options import COORDINATOR, parser_for
from specbatch.config.speculation import SpeculationConfig
from specbatch.models.loading import ModelSpec, load_tokenizer, model_source
from specbatch.protocol.speculation import MAX_K
from specbatch.rpc.metrics import new_registry, serve_metrics
from specbatch.rpc.server import PortUnavailable, Server, configure_logging
from specbatch.rpc.tls import channel_credentials_from_args, server_credentials_from_args
from specbatch.v1 import generation_pb2_grpc as pb_grpc

from .admission import Limits, longest_token_chars
from .backends import DraftClient, TargetClient
from .choose import fit_policy, learning_per_replica, parse_policy
from .fit import Deployment
from .learned import Learning
from .learned_store import Keeper
from .metrics import CoordinatorMetrics
from .profile_file import ProfileFile
from .replicas import DNS_PREFIX, NotReady, ReplicaSet
from .scheduler import Scheduler
from .servicer import GenerationServicer

log = logging.getLogger(__name__)


@dataclass
class Coordinator:
    server: Server
    scheduler: Scheduler
    targets: ReplicaSet
    drafts: ReplicaSet | None = None
    profile_file: ProfileFile | None = None
    metrics_server: object | None = None
    keeper: Keeper | None = None  # what a learn policy learned, kept under the cache

    @property
    def port(self) -> int:
        return self.server.port

    def drain(self, grace: float) -> None:
        """Graceful shutdown: health goes NOT_SERVING (load balancers stop sending), new requests
        get UNAVAILABLE, and requests in flight finish within ``grace`` seconds."""
        log.info("draining: %d running, %d waiting (grace %.0fs)", *self.scheduler.load(), grace)
        self.server.set_not_serving()
        self.scheduler.drain(grace)
        self.stop(grace=1.0)

    def stop(self, grace: float = 5.0) -> None:
        if self.profile_file is not None:
            self.profile_file.stop()
        self.scheduler.stop()
        if self.keeper is not None:
            self.keeper.stop()
        self.server.stop(grace)
        for replicas in filter(None, (self.targets, self.drafts)):
            replicas.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()


class SameModel:
    """A replica joins only if it serves what the first one served (model, vocabulary, features):
    sequences move between replicas, so every replica must compute the same thing."""

    def __init__(self, service: str):
        self.service = service
        self.stats = None
        self.lock = threading.Lock()

    def __call__(self, client):
        """The replica's CacheStats, or NotReady."""
        stats = client.cache_stats()
        with self.lock:
            if self.stats is None:
                self.stats = stats
                return stats
            mine = (stats.model, stats.vocab_size, stats.feature_size)
            first = (self.stats.model, self.stats.vocab_size, self.stats.feature_size)
        if mine != first or stats.max_context < self.stats.max_context:
            log.error("%s replica %s serves %s, not %s like the others: left out", self.service, client.address,
                      mine, first)
            raise NotReady(f"serves {mine}, expected {first}")
        return stats


def find_eos_token_ids(tokenizer, tokenizer_source: str | None) -> frozenset[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if tokenizer_source:
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(tokenizer_source).eos_token_id
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        except OSError:
            pass
    return frozenset(ids)


def build_coordinator(target_address: str, draft_address: str | None, tokenizer, *,
                      speculation: SpeculationConfig = SpeculationConfig(), profile_file: ProfileFile | None = None,
                      host: str = "127.0.0.1", port: int = 0, max_batch_size: int = 32, max_queue: int = 256,
                      max_new_tokens: int = 1024, max_prompt_tokens: int | None = None, timeout: float = 120.0,
                      draft_timeout: float = 10.0, eos_token_ids: frozenset[int] | None = None,
                      tokenizer_name: str = "", profile_poll_seconds: float = 2.0, credentials=None,
                      tls_server_name: str | None = None, server_credentials=None, refresh_seconds: float = 10.0,
                      wait_seconds: float = 30.0, metrics_host: str = "127.0.0.1", metrics_port: int | None = 0,
                      prefill_chunk: int = 0, stream_interval: int = 1) -> Coordinator:
    """``target_address``/``draft_address``: one address, a comma-separated list of replicas, or
    ``dns:NAME:PORT`` (re-resolved every ``refresh_seconds``). ``speculation``: how the decode step
    speculates (its profile is read now and re-read when it changes, unless ``profile_file`` is that
    file already open). ``credentials``: TLS for the calls to the services (``tls_server_name``: the
    name their certificates carry, when replicas are dialled by IP; default: a ``dns:NAME:PORT``
    spec's NAME); ``server_credentials``: TLS for the coordinator's own port. ``metrics_port``: Prometheus /metrics (0: none; None: the default
    port, skipped if taken). ``prefill_chunk``: the most prompt tokens prefilled between two decode
    steps (0: each admitted prompt whole; coordinator/scheduler.py). ``stream_interval``: the tokens
    a stream sends at once after its first (coordinator/requests.py). A profile that cannot be used,
    or services that do not fit together, raise ValueError before serving; a port in use,
    ``specbatch.rpc.server.PortUnavailable``."""
    speculation = speculation.check().resolved()
    if profile_file is None and speculation.profile:
        profile_file = ProfileFile(speculation.profile, profile_poll_seconds)
    k_policy = parse_policy(speculation.k_policy, MAX_K, profile_file, speculation.leaves, max_batch_size)
    metrics = CoordinatorMetrics(new_registry())

    def health_changed(replica) -> None:
        if replica.removed:  # gone from discovery: its series goes too
            metrics.forget_replica(replica.service, replica.address)
        else:
            metrics.set_replica_up(replica.service, replica.address, replica.healthy)

    def tls_name(spec: str) -> str | None:
        # Replicas found by DNS are dialled by IP, which no certificate can name: expect the name
        # the spec resolves (a Kubernetes Service's), unless told otherwise.
        if tls_server_name or not spec.strip().startswith(DNS_PREFIX):
            return tls_server_name
        return spec.strip()[len(DNS_PREFIX):].lstrip("/").rpartition(":")[0] or None

    def replicas(service: str, spec: str, make_client) -> ReplicaSet:
        return ReplicaSet(service, spec, make_client, SameModel(service), health_service=f"specbatch.v1.{service.title()}",
                          refresh_seconds=refresh_seconds, on_health=health_changed).start()

    targets = replicas("target", target_address, lambda address: TargetClient(
        address, timeout, credentials, server_name=tls_name(target_address)))
    drafts = None
    if draft_address:
        # A draft call gets one retry: with the draft down, steps go on target-only at once.
        drafts = replicas("draft", draft_address, lambda address: DraftClient(
            address, draft_timeout, credentials, attempts=2, server_name=tls_name(draft_address)))
    try:
        first_target = targets.wait_healthy(wait_seconds)
        target_stats = first_target.client.cache_stats()
        max_context = target_stats.max_context
        draft_model = "none"
        feature_size = 0
        if drafts is not None:
            draft_stats = drafts.wait_healthy(wait_seconds).client.cache_stats()
            if draft_stats.vocab_size != target_stats.vocab_size:
                raise ValueError(f"draft vocabulary ({draft_stats.vocab_size}) differs from the target's "
                                 f"({target_stats.vocab_size}): they must share a tokenizer")
            feature_size = draft_stats.feature_size
            if feature_size and feature_size != target_stats.feature_size:
                raise ValueError(f"the draft reads target features of size {feature_size}, but the target's are "
                                 f"{target_stats.feature_size}: it was trained for another target")
            max_context = min(max_context, draft_stats.max_context)
            draft_model = draft_stats.model
        # Bound before anything starts, so that a port in use (PortUnavailable) leaves nothing running.
        # One thread per open stream: room for a full batch, a full queue, Info calls, and refusals.
        # gRPC's own cap sits well above that, so a stream past the queue reaches the scheduler and
        # gets its RESOURCE_EXHAUSTED with a retry hint (gRPC's "Concurrent RPC limit" has none);
        # the cap only bounds what a flood can hold in memory.
        workers = max_batch_size + max_queue + 32
        server = Server(f"{host}:{port}", max_workers=workers, maximum_concurrent_rpcs=4 * workers,
                        credentials=server_credentials)
    except BaseException:
        for replicas in filter(None, (targets, drafts)):
            replicas.close()
        raise
    deployment = Deployment.from_stats(target_stats, draft_stats if drafts is not None else None,
                                       draft_address or "", target_address)
    k_policy = fit_policy(k_policy, profile_file, deployment, MAX_K, speculation.leaves, max_batch_size)
    keeper = None
    if isinstance(k_policy, Learning):  # what it learns is kept for the next start, and served by Info
        keeper = Keeper().start()
        k_policy = learning_per_replica(k_policy, first_target, deployment, draft_stats if drafts is not None else None,
                                        keeper, MAX_K, speculation.leaves, max_batch_size, profile_file)
    if eos_token_ids is None:
        eos_token_ids = find_eos_token_ids(tokenizer, None)
    limits = Limits(target_stats.vocab_size, max_context, max_new_tokens, eos_token_ids,
                    longest_token_chars(tokenizer), max_prompt_tokens)
    metrics.set_policy(k_policy.describe())
    scheduler = Scheduler(targets, drafts, k_policy, speculation, max_batch_size, max_queue, max_context,
                          feature_size, metrics=metrics, prefill_chunk=prefill_chunk)
    metrics.track_load(scheduler.load, max_batch_size)
    scheduler.start()
    if profile_file is not None:
        profile_file.start()
    if target_stats.emulated_acceptance:  # its output is not the target's: say so here too
        log.warning("the target EMULATES acceptance at rates %s (drafts kept by seeded draws, not verified): "
                    "output is not the target's, for timing only", target_stats.emulated_acceptance)
    servicer = GenerationServicer(scheduler, tokenizer, limits, target_stats.model, draft_model, tokenizer_name,
                                  keeper or profile_file, target_stats.emulated_acceptance, stream_interval)
    server.add(pb_grpc.add_GenerationServicer_to_server, servicer, "specbatch.v1.Generation")
    metrics_server = serve_metrics(metrics.registry, "coordinator", metrics_host, metrics_port)
    return Coordinator(server.start(), scheduler, targets, drafts, profile_file, metrics_server, keeper)


def main(argv=None) -> None:
    parser = parser_for(COORDINATOR, description="specbatch coordinator")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    # A bad profile, policy or TLS file is refused before waiting minutes for the services.
    try:
        speculation = SpeculationConfig.from_args(args).check().resolved()
        profile_file = ProfileFile(speculation.profile, args.profile_poll_seconds) if speculation.profile else None
        parse_policy(speculation.k_policy, MAX_K, profile_file, max_batch_size=args.max_batch_size)
        if args.prefill_chunk < 0:
            raise ValueError(f"--prefill-chunk must be 0 (off) or a number of tokens (got {args.prefill_chunk})")
        if args.stream_interval < 1:
            raise ValueError(f"--stream-interval must be 1 or more (got {args.stream_interval})")
    except ValueError as error:
        parser.error(str(error))
    server_credentials = server_credentials_from_args(args, parser)
    credentials = channel_credentials_from_args(args, parser)
    spec = ModelSpec.parse(args.tokenizer)
    tokenizer = load_tokenizer(spec)
    source, _ = model_source(spec)
    try:
        coordinator = build_coordinator(
            args.target, None if args.draft == "none" else args.draft, tokenizer, speculation=speculation,
            profile_file=profile_file, host=args.host, port=args.port, max_batch_size=args.max_batch_size,
            max_queue=args.max_queue, max_new_tokens=args.max_new_tokens_limit,
            max_prompt_tokens=args.max_prompt_tokens, timeout=args.timeout, draft_timeout=args.draft_timeout,
            eos_token_ids=find_eos_token_ids(tokenizer, source),
            tokenizer_name=spec.describe(), credentials=credentials, tls_server_name=args.service_tls_server_name,
            server_credentials=server_credentials, refresh_seconds=args.discovery_seconds,
            wait_seconds=args.wait_for_services, metrics_host=args.metrics_host, metrics_port=args.metrics_port,
            prefill_chunk=args.prefill_chunk, stream_interval=args.stream_interval)
    except PortUnavailable as error:  # taken while it waited for the services
        raise SystemExit(str(error)) from None
    log.info("coordinator serving on %s:%d (k policy %s)", args.host, coordinator.port, speculation.k_policy)
    coordinator.server.run_until_signal(on_stop=lambda: coordinator.drain(args.drain_seconds))
