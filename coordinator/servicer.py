"""The client API (specbatch.v1.Generation): a thin shell over admission and the scheduler."""

from __future__ import annotations

import json
import logging

import grpc

from specbatch import __version__
from specbatch.engine import InvalidRequest
from specbatch.v1 import generation_pb2 as pb
from specbatch.v1 import generation_pb2_grpc as pb_grpc

from .admission import Limits, build_request
from .requests import Failure
from .scheduler import QueueFull, Scheduler

log = logging.getLogger(__name__)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, scheduler: Scheduler, tokenizer, limits: Limits, target_model: str, draft_model: str,
                 tokenizer_name: str, profile_file=None):
        self.scheduler, self.tokenizer, self.limits = scheduler, tokenizer, limits
        self.names = (target_model, draft_model, tokenizer_name)
        self.profile_file = profile_file  # coordinator.profile_file.ProfileFile, or None

    def Generate(self, message, context):
        try:
            request = build_request(message, self.tokenizer, self.limits)
        except InvalidRequest as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        context.add_callback(request.cancel)  # the client went away or its deadline passed
        try:
            self.scheduler.submit(request)
        except QueueFull as error:
            context.set_trailing_metadata((("retry-after-ms", "1000"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{error}; retry later")
        while True:
            response = request.events.get()
            if isinstance(response, Failure):
                context.abort(response.code, response.message)
            yield response
            if response.finish_reason:
                return

    def Info(self, message, context):
        target, draft, tokenizer = self.names
        scheduler = self.scheduler
        return pb.InfoResponse(
            target_model=target,
            draft_model=draft,
            tokenizer=tokenizer,
            max_batch_size=scheduler.max_batch_size,
            max_queue=scheduler.max_queue,
            max_new_tokens_limit=self.limits.max_new_tokens,
            max_context=self.limits.max_context,
            k_policy=scheduler.policy.describe(),
            profile=self.profile_file.profile.to_json() if self.profile_file is not None else "",
            eos_token_id=min(self.limits.eos_token_ids, default=-1),
            version=__version__,
            totals=pb.StepTotals(**vars(scheduler.totals)),
            running=scheduler.load()[0],
            waiting=scheduler.load()[1],
        )
