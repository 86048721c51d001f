"""The client API (specbatch.v1.Generation): a thin shell over admission and the scheduler."""

from __future__ import annotations

import logging
import time

import grpc

from specbatch import __version__
from specbatch.protocol.errors import InvalidRequest
from specbatch.v1 import generation_pb2 as pb
from specbatch.v1 import generation_pb2_grpc as pb_grpc

from .admission import Limits, build_request
from .requests import Failure
from .scheduler import Draining, QueueFull, Scheduler

log = logging.getLogger(__name__)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, scheduler: Scheduler, tokenizer, limits: Limits, target_model: str, draft_model: str,
                 tokenizer_name: str, profile_file=None, emulated_acceptance: str = "", stream_interval: int = 1):
        self.scheduler, self.tokenizer, self.limits = scheduler, tokenizer, limits
        self.stream_interval = stream_interval  # tokens a stream sends at once after its first
        self.names = (target_model, draft_model, tokenizer_name)
        self.profile_file = profile_file  # coordinator.profile_file.ProfileFile, or None
        self.emulated_acceptance = emulated_acceptance  # the target's, from its CacheStats: "" when off

    def _refuse(self, context, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None):
        if self.scheduler.metrics:
            self.scheduler.metrics.observe_rejected(code.name)
        if retry_after_ms is not None:
            context.set_trailing_metadata((("retry-after-ms", str(retry_after_ms)),))
        context.abort(code, message)

    def Generate(self, message, context):
        try:
            request = build_request(message, self.tokenizer, self.limits, self.stream_interval)
        except InvalidRequest as error:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        context.add_callback(request.cancel)  # the client went away or its deadline passed
        # The client's deadline bounds the request and every service call made for it.
        remaining = context.time_remaining()
        if remaining is not None and remaining < 1e9:
            request.deadline = time.monotonic() + remaining
        try:
            self.scheduler.submit(request)
        except QueueFull as error:
            # The hint grows with the queue: roughly the time for a batch's worth to drain.
            self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{error}; retry later", self.retry_hint_ms())
        except Draining as error:
            self._refuse(context, grpc.StatusCode.UNAVAILABLE, f"{error}; retry (another coordinator)", 100)
        while True:
            response = request.events.get()
            if isinstance(response, Failure):
                if response.retry:
                    context.set_trailing_metadata((("retry-after-ms", str(self.retry_hint_ms())),))
                context.abort(response.code, response.message)
            yield response
            if response.finish_reason:
                return

    def retry_hint_ms(self) -> int:
        """When a retry may find room: about 32 steps (a short request's life) at the mean
        step time seen so far, within [0.25 s, 30 s]."""
        totals = self.scheduler.totals
        step_seconds = totals.step_seconds / totals.steps if totals.steps else 0.1
        return int(min(30_000, max(250, 1000 * 32 * step_seconds)))

    def profile_json(self) -> str:
        """The profile in force: the file's, or what a learn policy learned so far; empty: none."""
        profile = self.profile_file.profile if self.profile_file is not None else None
        return profile.to_json() if profile is not None else ""

    def Info(self, message, context):
        target, draft, tokenizer = self.names
        scheduler = self.scheduler
        services = scheduler.services
        return pb.InfoResponse(
            target_model=target,
            draft_model=draft,
            tokenizer=tokenizer,
            max_batch_size=scheduler.max_batch_size,
            max_queue=scheduler.max_queue,
            max_new_tokens_limit=self.limits.max_new_tokens,
            max_context=self.limits.max_context,
            k_policy=scheduler.policy.describe(),
            profile=self.profile_json(),
            eos_token_id=min(self.limits.eos_token_ids, default=-1),
            version=__version__,
            totals=pb.StepTotals(**vars(scheduler.totals)),
            running=scheduler.load()[0],
            waiting=scheduler.load()[1],
            replicas=[pb.ReplicaStatus(service=r.service, address=r.address, healthy=r.healthy,
                                       sequences=len(r.assigned), failures=r.failures)
                      for replicas in filter(None, (services.target_replicas, services.draft_replicas))
                      for r in replicas.all()],
            emulated_acceptance=self.emulated_acceptance,
        )
