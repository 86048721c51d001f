"""A small client for the Generation API: build requests, stream them, collect results."""

from __future__ import annotations

import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from specbatch.rpc.tls import open_channel
from specbatch.v1 import generation_pb2 as pb
from specbatch.v1 import generation_pb2_grpc as pb_grpc

FINISH_NAMES = {v.number: v.name.removeprefix("FINISH_REASON_").lower()
                for v in pb.FinishReason.DESCRIPTOR.values}


def connect(address: str, credentials: grpc.ChannelCredentials | None = None) -> pb_grpc.GenerationStub:
    """A Generation stub; over TLS with ``credentials`` (``specbatch.rpc.tls.channel_credentials``)."""
    return pb_grpc.GenerationStub(open_channel(address, credentials))


def make_request(prompt: str | list[int] | list[dict], max_new_tokens: int = 64, *, chat: bool = False,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 k: int | None = None, stop: list[str] = (), ignore_eos: bool = False,
                 leaves: int | None = None, prompt_lookup: int | None = None,
                 shared_lookup: bool | None = None, stream_interval: int | None = None) -> pb.GenerateRequest:
    request = pb.GenerateRequest(max_new_tokens=max_new_tokens, stop=list(stop), ignore_eos=ignore_eos,
                                 sampling=pb.SamplingParameters(temperature=temperature, top_p=top_p, top_k=top_k))
    if seed is not None:
        request.sampling.seed = seed
    if k is not None:
        request.k = k
    if leaves is not None:
        request.leaves = leaves
    if prompt_lookup is not None:
        request.prompt_lookup = prompt_lookup
    if shared_lookup is not None:
        request.shared_lookup = shared_lookup
    if stream_interval is not None:
        request.stream_interval = stream_interval
    if isinstance(prompt, str) and chat:
        request.chat.messages.add(role="user", content=prompt)
    elif isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        for message in prompt:
            request.chat.messages.add(role=message["role"], content=message["content"])
    else:
        request.token_ids.ids.extend(prompt)
    return request


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: str = ""
    stats: pb.RequestStats | None = None
    seconds: float = 0.0  # client-side, from sending to the last response
    first_token_seconds: float = 0.0

    @property
    def acceptance(self) -> float:
        s = self.stats
        return s.draft_tokens_accepted / s.draft_tokens_proposed if s and s.draft_tokens_proposed else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds else 0.0


def generate(stub, request: pb.GenerateRequest, on_response=None, timeout: float | None = None) -> Result:
    result = Result()
    start = time.perf_counter()
    for response in stub.Generate(request, timeout=timeout):
        if response.token_ids and not result.token_ids:
            result.first_token_seconds = time.perf_counter() - start
        result.token_ids.extend(response.token_ids)
        result.text += response.text
        if on_response:
            on_response(response)
        if response.finish_reason:
            result.finish = FINISH_NAMES[response.finish_reason]
            result.stats = response.stats
    result.seconds = time.perf_counter() - start
    return result


def generate_all(stub, requests: list[pb.GenerateRequest], concurrency: int | None = None,
                 timeout: float | None = None) -> list[Result]:
    """Run requests as concurrent streams (all at once by default); results in request order."""
    with futures.ThreadPoolExecutor(concurrency or len(requests)) as pool:
        return list(pool.map(lambda request: generate(stub, request, timeout=timeout), requests))
