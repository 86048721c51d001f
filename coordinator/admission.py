"""Turning a client's GenerateRequest into a Request, or a clear INVALID_ARGUMENT.

Everything a service could refuse is checked here, before the request joins a batch, so one bad
request never fails a step that other requests share.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass

from specbatch.models.loading import chat_token_ids
from specbatch.protocol.errors import InvalidRequest
from specbatch.protocol.sampling_params import SamplingParams
from specbatch.protocol.speculation import MAX_K, leaf_option_problems, prompt_lookup_problems
from specbatch.v1 import generation_pb2 as pb

from .requests import Request, TextStream

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    max_prompt_tokens: int | None = None  # None: whatever fits the context


def prompt_tokens(message: pb.GenerateRequest, tokenizer) -> list[int]:
    which = message.WhichOneof("prompt")
    if which == "text":
        if not message.text.strip():
            raise InvalidRequest("prompt text is empty")
        return list(tokenizer(message.text)["input_ids"])
    if which == "token_ids":
        return list(message.token_ids.ids)
    if which == "chat":
        messages = [{"role": m.role, "content": m.content} for m in message.chat.messages]
        if not messages or not any(m["content"].strip() for m in messages):
            raise InvalidRequest("chat prompt has no messages with content")
        try:
            return chat_token_ids(tokenizer, messages)
        except Exception as error:  # noqa: BLE001 - templates raise anything on bad roles
            raise InvalidRequest(f"chat messages do not fit the model's chat template: {error}") from None
    raise InvalidRequest("the request has no prompt: set text, token_ids or chat")


def sampling_from_request(message: pb.SamplingParameters) -> SamplingParams:
    top_p = message.top_p if message.top_p != 0 else 1.0  # proto3 default 0 means unset
    seed = message.seed if message.HasField("seed") else secrets.randbits(63)
    params = SamplingParams(message.temperature, top_p, message.top_k, seed)
    problems = params.problems()
    if problems:
        raise InvalidRequest("; ".join(problems))
    return params


def build_request(message: pb.GenerateRequest, tokenizer, limits: Limits) -> Request:
    prompt = prompt_tokens(message, tokenizer)
    if not prompt:
        raise InvalidRequest("prompt is empty")
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")
    if limits.max_prompt_tokens is not None and len(prompt) > limits.max_prompt_tokens:
        raise InvalidRequest(f"the prompt has {len(prompt)} tokens; the limit is {limits.max_prompt_tokens}")
    if not 1 <= message.max_new_tokens <= limits.max_new_tokens:
        raise InvalidRequest(f"max_new_tokens must be in [1, {limits.max_new_tokens}] (got {message.max_new_tokens})")
    if len(prompt) + message.max_new_tokens > limits.max_context:
        raise InvalidRequest(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({message.max_new_tokens}) exceeds the model's "
            f"context of {limits.max_context} tokens"
        )
    stops = list(message.stop)
    if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, each 1 to {MAX_STOP_STRING_CHARS} characters")
    stop_ids = set(message.stop_token_ids)
    if any(not 0 <= t < limits.vocab_size for t in stop_ids):
        raise InvalidRequest(f"stop_token_ids must be in [0, {limits.vocab_size})")
    if not message.ignore_eos:
        stop_ids |= limits.eos_token_ids
    fixed_k = message.k if message.HasField("k") else None
    if fixed_k is not None and not 0 <= fixed_k <= MAX_K:
        raise InvalidRequest(f"k must be in [0, {MAX_K}] (got {fixed_k})")
    fixed_leaves = message.leaves if message.HasField("leaves") else None
    prompt_lookup = message.prompt_lookup if message.HasField("prompt_lookup") else None
    problems = leaf_option_problems(fixed_leaves) + prompt_lookup_problems(prompt_lookup)
    if problems:
        raise InvalidRequest("; ".join(problems))
    return Request(
        id=message.request_id or uuid.uuid4().hex,
        prompt=prompt,
        max_new_tokens=message.max_new_tokens,
        sampling=sampling_from_request(message.sampling),
        stop_token_ids=frozenset(stop_ids),
        text=TextStream(tokenizer, stops),
        fixed_k=fixed_k,
        fixed_leaves=fixed_leaves,
        prompt_lookup=prompt_lookup,
        shared_lookup=in_shared_lookup(message),
    )


def in_shared_lookup(message: pb.GenerateRequest) -> bool:
    """Whether a request drafts from (and joins) the coordinator's shared lookup index: as it says,
    else yes, but for a sampled request with a seed of its own. Its tokens follow from prompt,
    parameters, seed, k and the draft's proposals (docs/exactness.md); drafts taken from other
    requests' texts would make them follow from other traffic too."""
    if message.HasField("shared_lookup"):
        return message.shared_lookup
    return not (message.sampling.temperature > 0 and message.sampling.HasField("seed"))
