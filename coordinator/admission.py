"""Turning a client's GenerateRequest into a Request, or a clear INVALID_ARGUMENT.

Everything a service could refuse is checked here, before the request joins a batch, so one bad
request never fails a step that other requests share.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass

from specbatch.models.loading import chat_text, chat_text_token_ids
from specbatch.protocol.errors import InvalidRequest
from specbatch.protocol.sampling_params import SamplingParams
from specbatch.protocol.speculation import MAX_K, leaf_option_problems, prompt_lookup_problems
from specbatch.v1 import generation_pb2 as pb

from .requests import Request, TextStream

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# A client's name for its request is echoed in every response and log line about it.
MAX_REQUEST_ID_CHARS = 256


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` can stand for: its vocabulary's longest
    entry. A byte-level BPE token's text has one character per byte it covers, a SentencePiece
    token's one per character (a byte-fallback token's is longer than the byte), so where the
    tokenizer keeps every character of its input, a text of more than this × n characters has
    more than n tokens (docs/operations.md#limits)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    max_token_chars: int  # longest_token_chars(tokenizer): bounds a text's size before tokenizing it
    max_prompt_tokens: int | None = None  # None: whatever fits the context

    @property
    def prompt_tokens(self) -> int:
        """The most tokens a prompt may have: one new token must still fit the context."""
        fits = self.max_context - 1
        return fits if self.max_prompt_tokens is None else min(fits, self.max_prompt_tokens)

    @property
    def prompt_chars(self) -> int:
        """The most characters a text (or chat) prompt may have: past this it is sure to exceed
        ``prompt_tokens`` and is refused before the tokenizer spends time on it."""
        return self.prompt_tokens * self.max_token_chars


def check_prompt_length(tokens: int, max_new_tokens: int, limits: Limits) -> None:
    if limits.max_prompt_tokens is not None and tokens > limits.max_prompt_tokens:
        raise InvalidRequest(f"the prompt has {tokens} tokens; the limit is {limits.max_prompt_tokens}")
    if tokens + max_new_tokens > limits.max_context:
        raise InvalidRequest(
            f"prompt ({tokens} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {limits.max_context} tokens"
        )


def _check_prompt_chars(chars: int, limits: Limits) -> None:
    if chars > limits.prompt_chars:
        raise InvalidRequest(
            f"the prompt has {chars} characters, more than its limit of {limits.prompt_tokens} tokens can hold "
            f"({limits.prompt_chars} characters: this tokenizer's tokens stand for at most "
            f"{limits.max_token_chars} characters each)"
        )


def prompt_tokens(message: pb.GenerateRequest, tokenizer, limits: Limits) -> list[int]:
    """The prompt's token ids. Its size is checked before any work that grows with it (a copy, a
    template, the tokenizer): a request may be as large as a gRPC message, 64 MiB."""
    which = message.WhichOneof("prompt")
    if which == "text":
        text = message.text
        _check_prompt_chars(len(text), limits)
        if not text.strip():
            raise InvalidRequest("prompt text is empty")
        return list(tokenizer(text)["input_ids"])
    if which == "token_ids":
        check_prompt_length(len(message.token_ids.ids), message.max_new_tokens, limits)
        return list(message.token_ids.ids)
    if which == "chat":
        chat = message.chat.messages
        # Every chat template writes at least a role's token for each message.
        if len(chat) > limits.prompt_tokens:
            raise InvalidRequest(f"the chat has {len(chat)} messages; a prompt of at most {limits.prompt_tokens} "
                                 "tokens has room for fewer")
        # The template writes each role and content into the text it renders, and more around them.
        _check_prompt_chars(sum(len(m.role) + len(m.content) for m in chat), limits)
        messages = [{"role": m.role, "content": m.content} for m in chat]
        if not messages or not any(m["content"].strip() for m in messages):
            raise InvalidRequest("chat prompt has no messages with content")
        try:
            rendered = chat_text(tokenizer, messages)
        except Exception as error:  # noqa: BLE001 - templates raise anything on bad roles
            raise InvalidRequest(f"chat messages do not fit the model's chat template: {error}") from None
        _check_prompt_chars(len(rendered), limits)
        return chat_text_token_ids(tokenizer, rendered)
    raise InvalidRequest("the request has no prompt: set text, token_ids or chat")


def sampling_from_request(message: pb.SamplingParameters) -> SamplingParams:
    top_p = message.top_p if message.top_p != 0 else 1.0  # proto3 default 0 means unset
    seed = message.seed if message.HasField("seed") else secrets.randbits(63)
    params = SamplingParams(message.temperature, top_p, message.top_k, seed)
    problems = params.problems()
    if problems:
        raise InvalidRequest("; ".join(problems))
    return params


def build_request(message: pb.GenerateRequest, tokenizer, limits: Limits, stream_interval: int = 1) -> Request:
    # Every bound that is cheap to check comes first, the prompt's size before its tokens: a
    # request costs little more than its message to refuse.
    if len(message.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id has {len(message.request_id)} characters; the limit is {MAX_REQUEST_ID_CHARS}")
    if not 1 <= message.max_new_tokens <= limits.max_new_tokens:
        raise InvalidRequest(f"max_new_tokens must be in [1, {limits.max_new_tokens}] (got {message.max_new_tokens})")
    stops = message.stop
    if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, each 1 to {MAX_STOP_STRING_CHARS} characters")
    # More ids than the vocabulary holds repeat some: nothing a client needs.
    if len(message.stop_token_ids) > limits.vocab_size:
        raise InvalidRequest(f"at most {limits.vocab_size} stop_token_ids (the vocabulary's size)")
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
    if message.HasField("stream_interval"):
        if message.stream_interval < 0:
            raise InvalidRequest(f"stream_interval must be 0 (the whole output at its end) or more "
                                 f"(got {message.stream_interval})")
        stream_interval = message.stream_interval
    sampling = sampling_from_request(message.sampling)
    prompt = prompt_tokens(message, tokenizer, limits)
    if not prompt:
        raise InvalidRequest("prompt is empty")
    check_prompt_length(len(prompt), message.max_new_tokens, limits)
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")
    return Request(
        id=message.request_id or uuid.uuid4().hex,
        prompt=prompt,
        max_new_tokens=message.max_new_tokens,
        sampling=sampling,
        stop_token_ids=frozenset(stop_ids),
        text=TextStream(tokenizer, list(stops)),
        fixed_k=fixed_k,
        fixed_leaves=fixed_leaves,
        prompt_lookup=prompt_lookup,
        shared_lookup=in_shared_lookup(message),
        stream_interval=stream_interval,
    )


def in_shared_lookup(message: pb.GenerateRequest) -> bool:
    """Whether a request drafts from (and joins) the coordinator's shared lookup index: as it says,
    else yes, but for a sampled request with a seed of its own. Its tokens follow from prompt,
    parameters, seed, k and the draft's proposals (docs/exactness.md); drafts taken from other
    requests' texts would make them follow from other traffic too."""
    if message.HasField("shared_lookup"):
        return message.shared_lookup
    return not (message.sampling.temperature > 0 and message.sampling.HasField("seed"))
