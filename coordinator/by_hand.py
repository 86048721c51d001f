"""A scheduler stepped by hand: one target and one draft client, a fixed set of requests admitted
at once, and no loop thread; its holder calls ``step()``. The serving code path, one step at a
time: the profiler measures serving steps this way, and distill's evaluation decodes through it
(over the services' servicers in process: coordinator/in_process.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from specbatch.config.speculation import SpeculationConfig
from specbatch.protocol.sampling_params import SamplingParams

from .replicas import ReplicaSet
from .requests import Request, TextStream
from .scheduler import Scheduler


class NoText:
    """A tokenizer for requests whose text nobody reads: every token decodes to nothing."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


def greedy_request(name: str, prompt: list[int], max_new_tokens: int, tokenizer=None,
                   stop_token_ids=frozenset()) -> Request:
    """A greedy request, its text decoded by ``tokenizer`` (None: no text)."""
    return Request(id=name, prompt=list(prompt), max_new_tokens=max_new_tokens, sampling=SamplingParams(),
                   stop_token_ids=frozenset(stop_token_ids), text=TextStream(tokenizer or NoText(), []))


@contextlib.contextmanager
def stepped_by_hand(target, draft, requests: list[Request], policy, speculation: SpeculationConfig,
                    max_context: int, draft_feature_size: int) -> Iterator[Scheduler]:
    """A scheduler over the two clients (each one replica, taken as healthy) with ``requests``
    admitted and prefilled at once, as the coordinator admits a burst. ``policy``: the k policy
    (``scheduler.policy`` may be swapped between steps). On exit the requests' sequences are
    released on both services."""
    scheduler = Scheduler(ReplicaSet.of("target", target), ReplicaSet.of("draft", draft), policy, speculation,
                          max_batch_size=len(requests), max_queue=len(requests), max_context=max_context,
                          draft_feature_size=draft_feature_size)
    try:
        for request in requests:
            scheduler.submit(request)
        scheduler.admit()
        if len(scheduler.running) != len(requests):
            raise RuntimeError(f"the services admitted {len(scheduler.running)} of {len(requests)} sequences "
                               "(KV cache budget or --max-sequences too small?)")
        yield scheduler
    finally:
        for request in requests:
            request.cancel()
        scheduler.retire()  # releases the sequences on both services
        scheduler.services.close()
