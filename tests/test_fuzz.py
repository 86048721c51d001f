"""Property-based fuzzing of the client API (specbatch.v1.Generation/Generate) with hypothesis.

Every request, however odd, must either stream to a normal finish (tokens in the vocabulary, at
most max_new_tokens of them, greedy ones equal to target-only decoding) or be refused with a
status from a small allowed set, never INTERNAL, UNKNOWN or a hang; an independent oracle says
which requests are valid, and the coordinator must agree with it. Meanwhile greedy requests run
one after another in the background and every one must be token-identical to target-only
decoding; afterwards the stack still serves and holds no sequence.

SPECBATCH_FUZZ_EXAMPLES raises the number of examples (default 100). The examples are drawn from a
fixed seed, so every run of the suite sends the same requests and takes about as long (a fresh
seed's run time varies severalfold, by how many long generations it draws);
SPECBATCH_FUZZ_SEED=<n> draws another set, SPECBATCH_FUZZ_SEED=random a new one every run.
"""

from __future__ import annotations

import math
import os
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from tiny import EOS, VOCAB, greedy_reference

from specbatch.models.loading import chat_token_ids
from specbatch.rpc.client import generate, make_request
from specbatch.stack.in_process import start_local_stack
from specbatch.v1 import generation_pb2 as pb

LIMIT = 128  # the stack's max_new_tokens limit
CONTEXT = 256  # the tiny models' context
MAX_K = 16
MAX_LEAVES = 8
ALLOWED_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
EXAMPLES = int(os.environ.get("SPECBATCH_FUZZ_EXAMPLES", "100"))
SEED = os.environ.get("SPECBATCH_FUZZ_SEED", "0")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
WORDS = [f"w{i}" for i in range(VOCAB - 5)] + ["<s>", "</s>", "<unk>", ":"]

# ---- strategies ----------------------------------------------------------------------------------

int32 = st.integers(INT32_MIN, INT32_MAX)
valid_id = st.integers(0, VOCAB - 1)
any_id = st.one_of(valid_id, st.sampled_from([-1, INT32_MIN, VOCAB, VOCAB + 1, INT32_MAX]), int32)
sentence = st.lists(st.sampled_from(WORDS), min_size=1, max_size=12).map(" ".join)
long_text = st.integers(CONTEXT - 20, 4 * CONTEXT).map(lambda n: " ".join(["w7"] * n))
huge_text = st.just("w9 " * 20_000)  # 60 KB: far past the context
odd_text = st.text(max_size=40)  # any unicode, blank, control characters…


def long_ids(n: int) -> list[int]:
    return [1] + [7] * (n - 1)


role = st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "", "USER", "🤖"]), st.text(max_size=12))
content = st.one_of(sentence, odd_text, st.just(""), st.just("   "), long_text, huge_text)
chat = st.lists(st.fixed_dictionaries({"role": role, "content": content}), max_size=4)
stop_string = st.one_of(st.text(max_size=8), sentence, st.just(""), st.text(min_size=250, max_size=300),
                        st.sampled_from(["w1", "</s>", "é", "🙂", "\n", "\x00", "w" * 256, "w" * 257]))
valid_chat = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                              "content": sentence}), min_size=1, max_size=3)
valid_stop = st.one_of(sentence, st.text(min_size=1, max_size=8))
special_floats = [-0.0, -1.0, math.nan, -math.nan, math.inf, -math.inf, 1e-45, 1e-38, 1e30, 3.4e38]

# Each field: (valid values, anything the wire can carry). A request takes most fields from the
# first and a few from the second, so that valid requests run too and each refusal has one cause
# more often than not.
FIELDS = {
    "prompt": (
        st.one_of(st.tuples(st.just("token_ids"), st.lists(valid_id, min_size=1, max_size=24)),
                  st.tuples(st.just("text"), sentence),
                  st.tuples(st.just("chat"), valid_chat)),
        st.one_of(
            st.tuples(st.just("token_ids"), st.one_of(
                st.lists(any_id, max_size=24), st.just([]),
                st.integers(CONTEXT - 12, CONTEXT + 40).map(long_ids))),  # around and past the context
            st.tuples(st.just("text"), st.one_of(sentence, odd_text, long_text, huge_text)),
            st.tuples(st.just("chat"), chat),
            st.tuples(st.just("none"), st.none()),
        ),
    ),
    "max_new_tokens": (
        # Short: a long generation tests nothing a short one does not, and costs seconds (the
        # wild values below still reach LIMIT).
        st.one_of(st.integers(1, 8), st.integers(1, 8), st.integers(9, 32)),
        st.one_of(st.integers(1, LIMIT), int32, st.sampled_from([0, -1, LIMIT, LIMIT + 1, INT32_MAX, INT32_MIN])),
    ),
    "temperature": (
        st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
        st.one_of(st.sampled_from(special_floats), st.floats(width=32)),
    ),
    "top_p": (
        st.one_of(st.just(0.0), st.just(1.0), st.floats(0.01, 1.0)),
        st.one_of(st.sampled_from(special_floats + [1.0000001, 2.0]), st.floats(width=32)),
    ),
    "top_k": (
        st.one_of(st.just(0), st.integers(1, 2 * VOCAB)),
        st.one_of(int32, st.sampled_from([-1, INT32_MIN, INT32_MAX])),
    ),
    "seed": (
        st.one_of(st.none(), st.integers(0, 2**64 - 1)),
        st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1]),
    ),
    "k": (
        st.one_of(st.none(), st.integers(0, MAX_K)),
        st.one_of(int32, st.sampled_from([-1, MAX_K + 1, INT32_MAX, INT32_MIN])),
    ),
    "leaves": (
        st.one_of(st.none(), st.integers(0, MAX_LEAVES)),
        st.one_of(int32, st.sampled_from([-1, MAX_LEAVES + 1, INT32_MAX, INT32_MIN])),
    ),
    "stop": (
        st.one_of(st.just([]), st.lists(valid_stop, max_size=3)),
        st.one_of(st.lists(stop_string, max_size=4), st.lists(stop_string, min_size=15, max_size=20)),
    ),
    "stop_token_ids": (
        st.one_of(st.just([]), st.lists(valid_id, max_size=3)),
        st.lists(any_id, min_size=1, max_size=4),
    ),
    "ignore_eos": (st.booleans(), st.booleans()),
    "stream_interval": (
        st.one_of(st.none(), st.integers(0, 8), st.just(INT32_MAX)),
        st.one_of(st.integers(INT32_MIN, -1), st.sampled_from([-1, INT32_MIN])),
    ),
    "request_id": (
        st.one_of(st.just(""), st.text(alphabet="abcdef0123456789-", max_size=32)),
        st.one_of(st.text(max_size=40), st.text(min_size=500, max_size=2000)),
    ),
    # The client gives up: a short deadline, or cancel after that many responses.
    "abandon": (
        st.none(),
        st.one_of(st.tuples(st.just("deadline"), st.floats(0.001, 0.5)),
                  st.tuples(st.just("cancel"), st.integers(0, 3))),
    ),
}


@st.composite
def requests(draw) -> dict:
    wild = draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=3))
    return {name: draw(FIELDS[name][name in wild]) for name in FIELDS}


def build(fields: dict) -> pb.GenerateRequest:
    message = pb.GenerateRequest(max_new_tokens=fields["max_new_tokens"], stop=fields["stop"],
                                 stop_token_ids=fields["stop_token_ids"], ignore_eos=fields["ignore_eos"],
                                 request_id=fields["request_id"])
    # float fields are float32 on the wire: the message keeps what the server will read
    message.sampling.temperature = fields["temperature"]
    message.sampling.top_p = fields["top_p"]
    message.sampling.top_k = fields["top_k"]
    if fields["seed"] is not None:
        message.sampling.seed = fields["seed"]
    if fields["k"] is not None:
        message.k = fields["k"]
    if fields["leaves"] is not None:
        message.leaves = fields["leaves"]
    if fields["stream_interval"] is not None:
        message.stream_interval = fields["stream_interval"]
    kind, value = fields["prompt"]
    if kind == "token_ids":
        message.token_ids.SetInParent()
        message.token_ids.ids.extend(value)
    elif kind == "text":
        message.text = value
    elif kind == "chat":
        message.chat.SetInParent()
        for m in value:
            message.chat.messages.add(role=m["role"], content=m["content"])
    return message


# ---- the oracle: which requests are valid, written from the API's documented limits ---------------


def oracle_prompt(message: pb.GenerateRequest, tokenizer) -> list[int] | str:
    """The prompt's token ids, or why there is none."""
    which = message.WhichOneof("prompt")
    if which is None:
        return "no prompt"
    if which == "text":
        if not message.text.strip():
            return "blank text"
        return list(tokenizer(message.text)["input_ids"]) or "text with no tokens"
    if which == "token_ids":
        return list(message.token_ids.ids) or "no token ids"
    messages = [{"role": m.role, "content": m.content} for m in message.chat.messages]
    if not any(m["content"].strip() for m in messages):
        return "chat without content"
    try:
        return chat_token_ids(tokenizer, messages) or "chat with no tokens"
    except Exception as error:  # noqa: BLE001
        return f"chat template refused: {error}"


def oracle(message: pb.GenerateRequest, tokenizer) -> tuple[list[int] | None, str | None]:
    """(prompt ids, None) for a valid request, (prompt or None, reason) for an invalid one."""
    prompt = oracle_prompt(message, tokenizer)
    if isinstance(prompt, str):
        return None, prompt
    s = message.sampling
    top_p = s.top_p if s.top_p != 0 else 1.0
    checks = [
        (all(0 <= t < VOCAB for t in prompt), "prompt token outside the vocabulary"),
        (1 <= message.max_new_tokens <= LIMIT, "max_new_tokens out of range"),
        (len(prompt) + message.max_new_tokens <= CONTEXT, "prompt + max_new_tokens past the context"),
        (math.isfinite(s.temperature) and s.temperature >= 0, "bad temperature"),
        (math.isfinite(top_p) and 0 < top_p <= 1, "bad top_p"),
        (s.top_k >= 0, "negative top_k"),
        (not message.HasField("k") or 0 <= message.k <= MAX_K, "k out of range"),
        (not message.HasField("leaves") or 0 <= message.leaves <= MAX_LEAVES, "leaves out of range"),
        (not message.HasField("stream_interval") or message.stream_interval >= 0, "negative stream_interval"),
        (len(message.request_id) <= 256, "request_id over 256 characters"),
        (len(message.stop) <= 16 and all(1 <= len(x) <= 256 for x in message.stop), "bad stop strings"),
        (all(0 <= t < VOCAB for t in message.stop_token_ids), "stop token outside the vocabulary"),
    ]
    for ok, reason in checks:
        if not ok:
            return prompt, reason
    return prompt, None


# ---- the stack and the background greedy requests ------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_stack(target_model, draft_model, tokenizer):
    stack = start_local_stack(target_model, draft_model, tokenizer, eos_token_ids=frozenset({EOS}), max_batch_size=8,
                              max_new_tokens=LIMIT)
    yield stack
    stack.stop()


class Background:
    """Greedy requests of 100 tokens (k=3, ignore_eos), one after another so that one is always in
    flight; each must equal target-only greedy decoding."""

    PROMPTS = [[1, 23, 8, 61, 30], [1, 5, 77, 12], [1, 44, 44, 9, 70, 3, 18], [1, 90]]
    TOKENS = 100

    def __init__(self, stack, target_model):
        self.stub = stack.client()
        self.references = [greedy_reference(target_model, p, self.TOKENS) for p in self.PROMPTS]
        self.done = 0
        self.problems: list[str] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self.stopping.is_set():
            prompt, reference = self.PROMPTS[i % len(self.PROMPTS)], self.references[i % len(self.PROMPTS)]
            i += 1
            try:
                result = generate(self.stub, make_request(prompt, self.TOKENS, k=3, ignore_eos=True), timeout=120)
            except grpc.RpcError as error:
                self.problems.append(f"background {prompt}: {error.code().name}: {error.details()}")
                continue
            if result.token_ids != reference or result.finish != "length":
                self.problems.append(f"background {prompt}: {result.finish}, {result.token_ids} != {reference}")
            self.done += 1

    def __enter__(self) -> "Background":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join(timeout=120)


# ---- the property --------------------------------------------------------------------------------


def call(stub, message: pb.GenerateRequest, abandon) -> list[pb.GenerateResponse]:
    how, value = abandon or (None, None)
    stream = stub.Generate(message, timeout=value if how == "deadline" else 20)
    if how == "cancel" and value == 0:
        stream.cancel()
    responses = []
    for response in stream:
        responses.append(response)
        if how == "cancel" and len(responses) == value:
            stream.cancel()
    return responses


def check(stub, message: pb.GenerateRequest, abandon, tokenizer, target_model, tally) -> None:
    prompt, invalid = oracle(message, tokenizer)
    gave_up = {"deadline": grpc.StatusCode.DEADLINE_EXCEEDED, "cancel": grpc.StatusCode.CANCELLED}.get(
        (abandon or (None,))[0])
    try:
        responses = call(stub, message, abandon)
    except grpc.RpcError as error:
        code = error.code()
        tally[code.name] = tally.get(code.name, 0) + 1
        if code == gave_up:
            return  # the client's own doing; the stack must still clean up (checked at the end)
        assert code in ALLOWED_REFUSALS, f"{code.name}: {error.details()} (oracle: {invalid or 'valid'})"
        if invalid:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{invalid}, but {code.name}: {error.details()}"
        else:
            assert code != grpc.StatusCode.INVALID_ARGUMENT, f"a valid request refused: {error.details()}"
        assert error.details(), "a refusal without a message"
        return
    tally["OK"] = tally.get("OK", 0) + 1
    assert invalid is None, f"accepted an invalid request ({invalid})"
    assert responses, "an empty stream"
    *body, last = responses
    assert last.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP, pb.FINISH_REASON_EOS), last
    assert not any(r.finish_reason for r in body), "a finish reason before the last response"
    tokens = [t for r in responses for t in r.token_ids]
    assert all(0 <= t < VOCAB for t in tokens), tokens
    assert len(tokens) <= message.max_new_tokens
    assert last.stats.generated_tokens == len(tokens) and last.stats.prompt_tokens == len(prompt)
    if message.request_id:
        assert all(r.request_id == message.request_id for r in responses)
    else:
        assert len({r.request_id for r in responses}) == 1 and responses[0].request_id
    if last.finish_reason == pb.FINISH_REASON_LENGTH:
        assert len(tokens) == message.max_new_tokens
    if last.finish_reason == pb.FINISH_REASON_EOS:
        ends = set(message.stop_token_ids) | (set() if message.ignore_eos else {EOS})
        assert tokens and tokens[-1] in ends and not ends & set(tokens[:-1]), tokens
    if message.sampling.temperature == 0:  # greedy: a prefix of target-only decoding
        reference = greedy_reference(target_model, prompt, message.max_new_tokens)
        assert tokens == reference[: len(tokens)], (tokens, reference)


@pytest.mark.timeout(300)
def test_fuzz_generate(fuzz_stack, tokenizer, target_model):
    stub = fuzz_stack.client()
    seen = {"valid": 0, "invalid": 0}
    tally: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(fields=requests())
    def fuzz(fields):
        message = build(fields)
        seen["invalid" if oracle(message, tokenizer)[1] else "valid"] += 1
        check(stub, message, fields["abandon"], tokenizer, target_model, tally)

    if SEED != "random":
        fuzz = seed(int(SEED))(fuzz)
    with Background(fuzz_stack, target_model) as background:
        fuzz()
        while background.done < 2 and not background.problems and background.thread.is_alive():
            time.sleep(0.1)  # at least two whole background requests overlapped the fuzzing
    if os.environ.get("SPECBATCH_FUZZ_STATS"):
        print(f"\nfuzz: {seen}, outcomes {tally}, background requests {background.done}")
    assert not background.problems, background.problems[:3]
    assert background.done >= 2
    assert seen["valid"] >= EXAMPLES // 10 and seen["invalid"] >= EXAMPLES // 10, seen

    # Still serving, and every refused, finished or stopped request left nothing behind.
    with grpc.insecure_channel(fuzz_stack.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    prompt = [1, 3, 5, 7]
    result = generate(stub, make_request(prompt, 20, k=2, ignore_eos=True), timeout=60)
    assert result.token_ids == greedy_reference(target_model, prompt, 20)
    deadline = time.monotonic() + 10
    while (fuzz_stack.target_engine.sequences or fuzz_stack.draft_engine.sequences) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not fuzz_stack.target_engine.sequences and not fuzz_stack.draft_engine.sequences
    info = stub.Info(pb.InfoRequest(), timeout=10)
    assert (info.running, info.waiting) == (0, 0)


def test_values_the_wire_cannot_carry_are_refused_by_the_client():
    """2**31 max_new_tokens, a negative or 2**64 seed: the protobuf runtime refuses them before
    anything is sent, so the server never sees them."""
    for set_field in (lambda m: setattr(m, "max_new_tokens", 2**31), lambda m: setattr(m, "k", -(2**31) - 1),
                      lambda m: setattr(m.sampling, "seed", -1), lambda m: setattr(m.sampling, "seed", 2**64)):
        with pytest.raises((ValueError, TypeError)):
            set_field(pb.GenerateRequest())
