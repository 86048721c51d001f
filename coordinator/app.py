"""Assembling a coordinator: connect to the services, learn their limits, serve the client API."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from draft_service.proposer import MAX_K
from specbatch.models import EMBEDDED, ModelSpec, load_tokenizer, model_source
from specbatch.serving import DEFAULT_PORTS, Server, configure_logging, wait_until_serving
from specbatch.v1 import generation_pb2_grpc as pb_grpc

from .admission import Limits
from .backends import DraftClient, TargetClient
from .policy import KNOWN as KNOWN_POLICIES
from .policy import parse_policy
from .profile_file import ProfileFile
from .scheduler import Scheduler
from .servicer import GenerationServicer

log = logging.getLogger(__name__)


@dataclass
class Coordinator:
    server: Server
    scheduler: Scheduler
    profile_file: ProfileFile | None = None

    @property
    def port(self) -> int:
        return self.server.port

    def stop(self, grace: float = 5.0) -> None:
        if self.profile_file is not None:
            self.profile_file.stop()
        self.scheduler.stop()
        self.server.stop(grace)


def eos_token_ids(tokenizer, tokenizer_source: str | None) -> frozenset[int]:
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


def build_coordinator(target_address: str, draft_address: str | None, tokenizer, *, policy: str = "fixed:3",
                      host: str = "127.0.0.1", port: int = 0, max_batch_size: int = 32, max_queue: int = 256,
                      max_new_tokens: int = 1024, timeout: float = 120.0, eos_ids: frozenset[int] | None = None,
                      tokenizer_name: str = "", profile: str | ProfileFile | None = None,
                      profile_poll_seconds: float = 2.0) -> Coordinator:
    """``profile``: a path (read now, re-read when it changes) or a ProfileFile already open.
    A profile that cannot be used raises ProfileError (a ValueError) before anything starts."""
    profile_file = ProfileFile(profile, profile_poll_seconds) if isinstance(profile, (str, Path)) else profile
    k_policy = parse_policy(policy, MAX_K, profile_file)
    target = TargetClient(target_address, timeout)
    draft = DraftClient(draft_address, timeout) if draft_address else None
    target_stats = target.cache_stats()
    max_context = target_stats.max_context
    draft_model = "none"
    feature_size = 0
    if draft is not None:
        draft_stats = draft.cache_stats()
        if draft_stats.vocab_size != target_stats.vocab_size:
            raise ValueError(f"draft vocabulary ({draft_stats.vocab_size}) differs from the target's "
                             f"({target_stats.vocab_size}): they must share a tokenizer")
        feature_size = draft_stats.feature_size
        if feature_size and feature_size != target_stats.feature_size:
            raise ValueError(f"the draft reads target features of size {feature_size}, but the target's are "
                             f"{target_stats.feature_size}: it was trained for another target")
        max_context = min(max_context, draft_stats.max_context)
        draft_model = draft_stats.model
    limits = Limits(target_stats.vocab_size, max_context, max_new_tokens,
                    eos_ids if eos_ids is not None else eos_token_ids(tokenizer, None))
    scheduler = Scheduler(target, draft, k_policy, max_batch_size, max_queue, max_context, feature_size).start()
    if profile_file is not None:
        profile_file.start()
    # One thread per open stream: room for a full batch, a full queue, and Info calls.
    server = Server(f"{host}:{port}", max_workers=max_batch_size + max_queue + 8,
                    maximum_concurrent_rpcs=max_batch_size + max_queue + 8)
    servicer = GenerationServicer(scheduler, tokenizer, limits, target_stats.model, draft_model, tokenizer_name,
                                  profile_file)
    server.add(pb_grpc.add_GenerationServicer_to_server, servicer, "specbatch.v1.Generation")
    return Coordinator(server.start(), scheduler, profile_file)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m coordinator", description="specbatch coordinator")
    parser.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORTS['target']}", help="target service address")
    parser.add_argument("--draft", default=f"127.0.0.1:{DEFAULT_PORTS['draft']}",
                        help="draft service address, or 'none' for target-only decoding")
    parser.add_argument("--tokenizer", default=EMBEDDED, help="tokenizer: hub id, folder, or the embedded default")
    parser.add_argument("--gguf-file", help="GGUF file name inside --tokenizer")
    parser.add_argument("--k-policy", default="fixed:3",
                        help=f"how k is chosen: {KNOWN_POLICIES} (the last two need --profile)")
    parser.add_argument("--profile", help="profile JSON made by `specbatch profile`; re-read when the file changes")
    parser.add_argument("--profile-poll-seconds", type=float, default=2.0,
                        help="how often to check the profile file for changes")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORTS["coordinator"])
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-queue", type=int, default=256)
    parser.add_argument("--max-new-tokens-limit", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline of each service call, seconds")
    parser.add_argument("--wait-for-services", type=float, default=300.0, help="seconds to wait for them to serve")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    # A bad profile or policy is refused before waiting minutes for the services.
    try:
        profile_file = ProfileFile(args.profile, args.profile_poll_seconds) if args.profile else None
        parse_policy(args.k_policy, MAX_K, profile_file)
    except ValueError as error:
        parser.error(str(error))
    draft = None if args.draft == "none" else args.draft
    for address in filter(None, (args.target, draft)):
        wait_until_serving(address, args.wait_for_services)
    spec = ModelSpec(args.tokenizer, args.gguf_file)
    tokenizer = load_tokenizer(spec)
    source, _ = model_source(spec)
    coordinator = build_coordinator(
        args.target, draft, tokenizer, policy=args.k_policy, host=args.host, port=args.port,
        max_batch_size=args.max_batch_size, max_queue=args.max_queue, max_new_tokens=args.max_new_tokens_limit,
        timeout=args.timeout, eos_ids=eos_token_ids(tokenizer, source), tokenizer_name=spec.describe(),
        profile=profile_file,
    )
    log.info("coordinator serving on %s:%d (k policy %s)", args.host, coordinator.port, args.k_policy)
    coordinator.server.run_until_signal(on_stop=coordinator.scheduler.stop)
