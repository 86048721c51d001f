"""Assembling a coordinator: connect to the services, learn their limits, serve the client API."""

from __future__ import annotations

import argparse
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from specbatch.models.embedded import EMBEDDED
from specbatch.models.loading import ModelSpec, load_tokenizer, model_source
from specbatch.protocol.speculation import (
    MAX_GUESSES,
    MAX_K,
    MAX_LEAVES,
    draft_ahead_problems,
    leaf_option_problems,
    prompt_lookup_problems,
    shared_lookup_problems,
)
from specbatch.rpc.metrics import new_registry, serve_metrics
from specbatch.rpc.server import DEFAULT_PORTS, Server, configure_logging
from specbatch.rpc.tls import (
    add_client_tls_flags,
    add_server_tls_flags,
    channel_credentials_from_args,
    server_credentials_from_args,
)
from specbatch.v1 import generation_pb2_grpc as pb_grpc

from .admission import Limits
from .backends import DraftClient, TargetClient
from .metrics import CoordinatorMetrics
from .policy import KNOWN as KNOWN_POLICIES
from .policy import parse_policy
from .profile_file import ProfileFile
from .replicas import NotReady, ReplicaSet
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

    def __call__(self, client) -> None:
        stats = client.cache_stats()
        with self.lock:
            if self.stats is None:
                self.stats = stats
                return
            mine = (stats.model, stats.vocab_size, stats.feature_size)
            first = (self.stats.model, self.stats.vocab_size, self.stats.feature_size)
        if mine != first or stats.max_context < self.stats.max_context:
            log.error("%s replica %s serves %s, not %s like the others: left out", self.service, client.address,
                      mine, first)
            raise NotReady(f"serves {mine}, expected {first}")


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


def check_draft_options(leaves: int, unsure_below: float, draft_ahead: int, prompt_lookup: int = 0,
                        shared_lookup: int = 0) -> None:
    """``--leaves``, ``--unsure-below``, ``--draft-ahead``, ``--prompt-lookup`` and
    ``--shared-lookup`` in range, else ValueError."""
    problems = (leaf_option_problems(leaves, unsure_below) + draft_ahead_problems(draft_ahead)
                + prompt_lookup_problems(prompt_lookup) + shared_lookup_problems(shared_lookup))
    if problems:
        raise ValueError("; ".join(problems))


def build_coordinator(target_address: str, draft_address: str | None, tokenizer, *, policy: str = "fixed:3",
                      host: str = "127.0.0.1", port: int = 0, max_batch_size: int = 32, max_queue: int = 256,
                      max_new_tokens: int = 1024, max_prompt_tokens: int | None = None, timeout: float = 120.0,
                      draft_timeout: float = 10.0,
                      eos_token_ids: frozenset[int] | None = None, tokenizer_name: str = "",
                      profile: str | ProfileFile | None = None, profile_poll_seconds: float = 2.0,
                      credentials=None, tls_server_name: str | None = None, server_credentials=None,
                      refresh_seconds: float = 10.0,
                      wait_seconds: float = 30.0, metrics_host: str = "127.0.0.1",
                      metrics_port: int | None = 0, leaves: int = 0, unsure_below: float = 0.0,
                      draft_ahead: int = 0, prompt_lookup: int = 0, shared_lookup: int = 0,
                      prefill_chunk: int = 0) -> Coordinator:
    """``target_address``/``draft_address``: one address, a comma-separated list of replicas, or
    ``dns:NAME:PORT`` (re-resolved every ``refresh_seconds``). ``profile``: a path (read now,
    re-read when it changes) or a ProfileFile already open. ``credentials``: TLS for the calls to
    the services (``tls_server_name``: the name their certificates carry, when replicas are dialled
    by IP); ``server_credentials``: TLS for the coordinator's own port. ``metrics_port``:
    Prometheus /metrics (0: none; None: the default port, skipped if taken). ``leaves``: the
    draft's next-best tokens verified beside the first drafted one (specbatch.engine.acceptance);
    ``unsure_below``: where the draft's first token is less likely than this, it drafts that token
    alone with k - 1 more leaves (the same rows on the target); ``draft_ahead``: tokens the draft
    guesses as the target's at each drafted position while the target verifies, drafting the next
    step after each (0: off; coordinator/step.py); ``prompt_lookup``: the most tokens drafted by
    copying what followed an earlier occurrence of the history's last tokens, in place of a Propose
    (0: off; coordinator/lookup.py); ``shared_lookup``: tokens of finished requests' texts kept for
    lookup where a request's own history has no match (0: off); ``prefill_chunk``: the most prompt
    tokens prefilled between two decode steps (0: each admitted prompt whole; coordinator/scheduler.py). A profile that
    cannot be used, or services that do not fit together, raise ValueError before serving."""
    profile_file = ProfileFile(profile, profile_poll_seconds) if isinstance(profile, (str, Path)) else profile
    check_draft_options(leaves, unsure_below, draft_ahead, prompt_lookup, shared_lookup)
    k_policy = parse_policy(policy, MAX_K, profile_file, leaves)
    metrics = CoordinatorMetrics(new_registry())

    def health_changed(replica) -> None:
        if replica.removed:  # gone from discovery: its series goes too
            metrics.forget_replica(replica.service, replica.address)
        else:
            metrics.set_replica_up(replica.service, replica.address, replica.healthy)

    def replicas(service: str, spec: str, make_client) -> ReplicaSet:
        return ReplicaSet(service, spec, make_client, SameModel(service), health_service=f"specbatch.v1.{service.title()}",
                          refresh_seconds=refresh_seconds, on_health=health_changed).start()

    targets = replicas("target", target_address,
                       lambda address: TargetClient(address, timeout, credentials, server_name=tls_server_name))
    drafts = None
    if draft_address:
        # A draft call gets one retry: with the draft down, steps go on target-only at once.
        drafts = replicas("draft", draft_address, lambda address: DraftClient(
            address, draft_timeout, credentials, attempts=2, server_name=tls_server_name))
    try:
        target_stats = targets.wait_healthy(wait_seconds).client.cache_stats()
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
    except BaseException:
        for replicas in filter(None, (targets, drafts)):
            replicas.close()
        raise
    if eos_token_ids is None:
        eos_token_ids = find_eos_token_ids(tokenizer, None)
    limits = Limits(target_stats.vocab_size, max_context, max_new_tokens, eos_token_ids, max_prompt_tokens)
    metrics.set_policy(k_policy.describe())
    scheduler = Scheduler(targets, drafts, k_policy, max_batch_size, max_queue, max_context, feature_size,
                          metrics=metrics, leaves=leaves, unsure_below=unsure_below, draft_ahead=draft_ahead,
                          prompt_lookup=prompt_lookup, shared_lookup=shared_lookup, prefill_chunk=prefill_chunk)
    metrics.track_load(scheduler.load, max_batch_size)
    scheduler.start()
    if profile_file is not None:
        profile_file.start()
    # One thread per open stream: room for a full batch, a full queue, Info calls, and refusals.
    # gRPC's own cap sits well above that, so a stream past the queue reaches the scheduler and
    # gets its RESOURCE_EXHAUSTED with a retry hint (gRPC's "Concurrent RPC limit" has none);
    # the cap only bounds what a flood can hold in memory.
    workers = max_batch_size + max_queue + 32
    server = Server(f"{host}:{port}", max_workers=workers, maximum_concurrent_rpcs=4 * workers,
                    credentials=server_credentials)
    servicer = GenerationServicer(scheduler, tokenizer, limits, target_stats.model, draft_model, tokenizer_name,
                                  profile_file)
    server.add(pb_grpc.add_GenerationServicer_to_server, servicer, "specbatch.v1.Generation")
    metrics_server = serve_metrics(metrics.registry, "coordinator", metrics_host, metrics_port)
    return Coordinator(server.start(), scheduler, targets, drafts, profile_file, metrics_server)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m coordinator", description="specbatch coordinator")
    replicas = ("one address, a comma-separated list of replicas, or dns:NAME:PORT to use every address "
                "a name resolves to (a Kubernetes headless Service), re-resolved every --discovery-seconds")
    parser.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORTS['target']}",
                        help=f"target service replicas: {replicas}")
    parser.add_argument("--draft", default=f"127.0.0.1:{DEFAULT_PORTS['draft']}",
                        help=f"draft service replicas ({replicas}), or 'none' for target-only decoding")
    parser.add_argument("--discovery-seconds", type=float, default=10.0, help="how often dns: endpoints are re-resolved")
    parser.add_argument("--tokenizer", default=EMBEDDED, help="tokenizer: hub id, folder, or the embedded default")
    parser.add_argument("--gguf-file", help="GGUF file name inside --tokenizer")
    parser.add_argument("--k-policy", default="fixed:3",
                        help=f"how k is chosen: {KNOWN_POLICIES} (all but fixed:K need --profile)")
    parser.add_argument("--leaves", type=int, default=0,
                        help=f"the most leaves (0 to {MAX_LEAVES}): the draft's next-best tokens at the first "
                             "drafted position, verified beside the chain (a rejected first draft whose target "
                             "token is one of them still yields 2 tokens); goodput verifies as many as pay, "
                             "fixed:K and profile all")
    parser.add_argument("--unsure-below", type=float, default=0.0, metavar="P",
                        help="where the draft's first token has probability below P (0 to 1), it drafts that "
                             "token alone and offers its next-best tokens in the rows the rest of the chain "
                             "would have taken (default 0: never)")
    parser.add_argument("--draft-ahead", type=int, default=0, metavar="N",
                        help=f"while the target verifies, the draft guesses its verdict (N of its likeliest "
                             f"tokens at each drafted position, 0 to {MAX_GUESSES}) and drafts the next step for "
                             "each guess; where one is right the next step needs no Propose (greedy requests; "
                             "default 0: off)")
    parser.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                        help=f"where the history's last 2-4 tokens occurred before in the request, draft the "
                             f"tokens that followed them (at most N, 0 to {MAX_K}, and the step's k, twice that at batch 1) "
                             "instead of asking the draft (default 0: off)")
    parser.add_argument("--shared-lookup", type=int, default=0, metavar="TOKENS",
                        help="keep the last TOKENS tokens of finished requests' prompts and outputs, and where a "
                             "request's own history has no match for --prompt-lookup, draft what followed its last "
                             "3-8 tokens there, where those texts agree (default 0: off; output is unchanged, but "
                             "a request's speed then depends on what others sent: docs/operations.md)")
    parser.add_argument("--profile", help="profile JSON made by `specbatch profile`; re-read when the file changes")
    parser.add_argument("--profile-poll-seconds", type=float, default=2.0,
                        help="how often to check the profile file for changes")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORTS["coordinator"])
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--prefill-chunk", type=int, default=0, metavar="TOKENS",
                        help="the most prompt tokens prefilled between two decode steps, first come first served, "
                             "a prompt split where it runs past them, so that a burst of prompts or a long one does "
                             "not hold up the running batch's tokens (default 0: each admitted prompt whole)")
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests waiting for a batch slot; past it, RESOURCE_EXHAUSTED with a retry hint")
    parser.add_argument("--max-new-tokens-limit", type=int, default=1024, help="the most max_new_tokens a request may ask")
    parser.add_argument("--max-prompt-tokens", type=int, help="the longest prompt accepted (default: what fits the context)")
    parser.add_argument("--timeout", type=float, default=120.0, help="longest target call, seconds")
    parser.add_argument("--draft-timeout", type=float, default=10.0,
                        help="longest draft call, seconds: a slower draft is set aside and steps run target-only")
    parser.add_argument("--drain-seconds", type=float, default=30.0,
                        help="on SIGTERM, how long requests in flight may take to finish")
    parser.add_argument("--wait-for-services", type=float, default=300.0,
                        help="seconds to wait for a target (and a draft) replica to serve")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="bind address of /metrics")
    parser.add_argument("--metrics-port", type=int,
                        help="Prometheus /metrics port (default 9090, skipped if taken; 0: none)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    add_server_tls_flags(parser)
    add_client_tls_flags(parser)
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    # A bad profile, policy or TLS file is refused before waiting minutes for the services.
    try:
        profile_file = ProfileFile(args.profile, args.profile_poll_seconds) if args.profile else None
        parse_policy(args.k_policy, MAX_K, profile_file)
        check_draft_options(args.leaves, args.unsure_below, args.draft_ahead, args.prompt_lookup, args.shared_lookup)
        if args.prefill_chunk < 0:
            raise ValueError(f"--prefill-chunk must be 0 (off) or a number of tokens (got {args.prefill_chunk})")
    except ValueError as error:
        parser.error(str(error))
    server_credentials = server_credentials_from_args(args, parser)
    credentials = channel_credentials_from_args(args, parser)
    spec = ModelSpec(args.tokenizer, args.gguf_file)
    tokenizer = load_tokenizer(spec)
    source, _ = model_source(spec)
    coordinator = build_coordinator(
        args.target, None if args.draft == "none" else args.draft, tokenizer, policy=args.k_policy, host=args.host,
        port=args.port, max_batch_size=args.max_batch_size, max_queue=args.max_queue,
        max_new_tokens=args.max_new_tokens_limit, max_prompt_tokens=args.max_prompt_tokens, timeout=args.timeout,
        draft_timeout=args.draft_timeout,
        eos_token_ids=find_eos_token_ids(tokenizer, source), tokenizer_name=spec.describe(), profile=profile_file,
        credentials=credentials, tls_server_name=args.service_tls_server_name,
        server_credentials=server_credentials, refresh_seconds=args.discovery_seconds,
        wait_seconds=args.wait_for_services, metrics_host=args.metrics_host, metrics_port=args.metrics_port,
        leaves=args.leaves, unsure_below=args.unsure_below, draft_ahead=args.draft_ahead,
        prompt_lookup=args.prompt_lookup, shared_lookup=args.shared_lookup, prefill_chunk=args.prefill_chunk,
    )
    log.info("coordinator serving on %s:%d (k policy %s)", args.host, coordinator.port, args.k_policy)
    coordinator.server.run_until_signal(on_stop=lambda: coordinator.drain(args.drain_seconds))
