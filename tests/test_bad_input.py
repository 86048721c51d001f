"""Bad input through the gRPC APIs of the in-process stack: clear statuses, and no harm to others."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from itertools import pairwise

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tiny import VOCAB, greedy_reference, hooked_forwards

from specbatch import __version__
from specbatch.rpc.client import generate, make_request
from specbatch.stack.in_process import start_local_stack
from specbatch.v1 import generation_pb2 as pb
from specbatch.v1 import model_services_pb2 as mpb
from specbatch.v1 import model_services_pb2_grpc as mpb_grpc

MAX_NEW_TOKENS = 128  # the stack fixture's limit
CONTEXT = 256  # the tiny models' max_position_embeddings
PROMPT = [1, 17, 42, 9, 33]


def request(**fields) -> pb.GenerateRequest:
    """A valid greedy request with some fields changed."""
    message = make_request(PROMPT, fields.pop("max_new_tokens", 8))
    for name, value in fields.items():
        if name in ("temperature", "top_p", "top_k"):
            setattr(message.sampling, name, value)
        else:
            setattr(message, name, value)
    return message


def no_prompt() -> pb.GenerateRequest:
    return pb.GenerateRequest(max_new_tokens=8)


def empty_token_ids() -> pb.GenerateRequest:
    message = no_prompt()
    message.token_ids.SetInParent()
    return message


def empty_chat() -> pb.GenerateRequest:
    message = no_prompt()
    message.chat.SetInParent()
    return message


def blank_chat() -> pb.GenerateRequest:
    return make_request([{"role": "user", "content": "  "}], 8)


def long_prompt(extra: int, max_new_tokens: int) -> pb.GenerateRequest:
    return make_request([1] + [7] * (CONTEXT - 1 + extra), max_new_tokens)


# The tiny tokenizer's longest token, "<pad>", has 5 characters: a prompt of at most 255 tokens
# (one new token must fit the context) holds at most 1275 characters.
PROMPT_CHARS = 5 * (CONTEXT - 1)


def words(n: int) -> str:
    return " ".join(["w7"] * n)


def many_stop_token_ids() -> pb.GenerateRequest:
    message = request()
    message.stop_token_ids.extend([5] * (VOCAB + 1))
    return message


# (name, request, words the error message must contain)
BAD_REQUESTS = [
    ("empty text", lambda: make_request("", 8), "prompt text is empty"),
    ("blank text", lambda: make_request("  \n ", 8), "prompt text is empty"),
    ("no prompt", no_prompt, "no prompt"),
    ("empty token_ids", empty_token_ids, "prompt is empty"),
    ("token id = vocab", lambda: make_request([1, VOCAB], 8), f"[{VOCAB}] are outside the vocabulary"),
    ("negative token id", lambda: make_request([1, -3, 5], 8), "[-3] are outside the vocabulary"),
    ("max_new_tokens 0", lambda: request(max_new_tokens=0), f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}] (got 0)"),
    ("max_new_tokens negative", lambda: request(max_new_tokens=-4), "max_new_tokens must be in [1, 128] (got -4)"),
    ("max_new_tokens over limit", lambda: request(max_new_tokens=MAX_NEW_TOKENS + 1), "(got 129)"),
    ("negative temperature", lambda: request(temperature=-0.5), "temperature"),
    ("NaN temperature", lambda: request(temperature=float("nan")), "temperature"),
    ("infinite temperature", lambda: request(temperature=float("inf")), "temperature"),
    ("top_p above 1", lambda: request(top_p=1.5), "top_p"),
    ("negative top_p", lambda: request(top_p=-0.2), "top_p"),
    ("negative top_k", lambda: request(top_k=-1), "top_k must be >= 0"),
    ("prompt longer than context", lambda: long_prompt(1, 1), f"context of {CONTEXT}"),
    ("prompt + max_new_tokens over context", lambda: long_prompt(-10, 11), f"context of {CONTEXT}"),
    ("k above 16", lambda: request(k=17), "k must be in [0, 16] (got 17)"),
    ("negative k", lambda: request(k=-1), "k must be in [0, 16] (got -1)"),
    ("leaves above 8", lambda: request(leaves=9), "leaves must be in [0, 8] (got 9)"),
    ("negative leaves", lambda: request(leaves=-1), "leaves must be in [0, 8] (got -1)"),
    ("empty chat", empty_chat, "chat prompt has no messages"),
    ("chat of blank messages", blank_chat, "chat prompt has no messages"),
    ("empty stop string", lambda: make_request(PROMPT, 8, stop=[""]), "stop strings"),
    ("17 stop strings", lambda: make_request(PROMPT, 8, stop=["w1"] * 17), "at most 16 stop strings"),
    ("stop string of 257 characters", lambda: make_request(PROMPT, 8, stop=["w" * 257]), "1 to 256 characters"),
    ("text past its size bound", lambda: make_request(words(PROMPT_CHARS // 3 + 1), 8),
     f"characters, more than its limit of {CONTEXT - 1} tokens can hold ({PROMPT_CHARS} characters"),
    ("chat past its size bound", lambda: make_request([{"role": "user", "content": words(PROMPT_CHARS // 3)}], 8),
     f"more than its limit of {CONTEXT - 1} tokens can hold"),
    ("chat of more messages than tokens", lambda: make_request([{"role": "user", "content": "w7"}] * CONTEXT, 8),
     f"the chat has {CONTEXT} messages"),
    ("a million token ids", lambda: make_request([7] * 1_000_000, 8), f"context of {CONTEXT}"),
    ("request_id of 257 characters", lambda: request(request_id="r" * 257),
     "request_id has 257 characters; the limit is 256"),
    ("more stop_token_ids than the vocabulary", many_stop_token_ids, f"at most {VOCAB} stop_token_ids"),
]


def refusal(stub, message: pb.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(message, timeout=20))
    return caught.value


def test_bad_requests_are_well_formed_messages():
    """Guard the table: the oneofs really are set (or unset) as each case means."""
    assert make_request("", 8).WhichOneof("prompt") == "text"
    assert no_prompt().WhichOneof("prompt") is None
    assert empty_token_ids().WhichOneof("prompt") == "token_ids"
    assert empty_chat().WhichOneof("prompt") == "chat"
    assert len(long_prompt(1, 1).token_ids.ids) == CONTEXT + 1


@pytest.mark.parametrize("make, words", [(m, w) for _, m, w in BAD_REQUESTS], ids=[n for n, _, _ in BAD_REQUESTS])
def test_bad_request_is_invalid_argument(stack, make, words):
    error = refusal(stack.client(), make())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert words in error.details()
    # Refused at admission: nothing was queued or cached.
    assert stack.coordinator.scheduler.load() == (0, 0)
    assert not stack.target_engine.sequences and not stack.draft_engine.sequences


def test_boundaries_just_inside_the_limits_are_accepted(stack, target_model):
    client = stack.client()
    prompt = [1] + [7] * (CONTEXT - 4)  # prompt + max_new_tokens == context exactly
    result = generate(client, make_request(prompt, 3, k=16, ignore_eos=True), timeout=60)
    assert result.finish == "length" and result.token_ids == greedy_reference(target_model, prompt, 3)
    result = generate(client, make_request(PROMPT, MAX_NEW_TOKENS, k=0, ignore_eos=True), timeout=60)
    assert len(result.token_ids) == MAX_NEW_TOKENS
    # The longest text prompt: as many tokens as fit beside one new token.
    result = generate(client, make_request(words(CONTEXT - 1), 1, ignore_eos=True), timeout=60)
    assert result.stats.prompt_tokens == CONTEXT - 1 and len(result.token_ids) == 1
    result = generate(client, make_request([{"role": "user", "content": words(80)}], 1, ignore_eos=True), timeout=60)
    assert result.finish == "length"


def test_bad_requests_do_not_disturb_a_running_request(stack, target_model):
    prompt = [1, 23, 8, 61, 30, 12, 77]
    reference = greedy_reference(target_model, prompt, 100)
    # Hold the target's third forward (a decode step of the valid request) until every bad
    # request has been refused, so they are provably sent while that request is mid-stream.
    forwards, reached, gate = [0], threading.Event(), threading.Event()

    def hold(fed):
        forwards[0] += 1
        if forwards[0] == 3:
            reached.set()
            gate.wait(30)

    streamed: list[int] = []
    result = {}

    def run():
        result["valid"] = generate(stack.client(), make_request(prompt, 100, ignore_eos=True),
                                   on_response=lambda r: streamed.extend(r.token_ids), timeout=120)

    thread = threading.Thread(target=run)
    with hooked_forwards(stack.target_engine, hold):
        try:
            thread.start()
            assert reached.wait(30), "the valid request never reached a decode step"
            client = stack.client()
            codes = {}
            for name, make, words in BAD_REQUESTS:
                error = refusal(client, make())
                codes[name] = (error.code(), words in error.details())
            info = client.Info(pb.InfoRequest(), timeout=10)
            assert (info.running, info.waiting) == (1, 0)  # the bad ones never joined the batch
            assert thread.is_alive() and "valid" not in result
            assert 0 < len(streamed) < 100
        finally:
            gate.set()
            thread.join(timeout=120)
    assert codes == {name: (grpc.StatusCode.INVALID_ARGUMENT, True) for name, _, _ in BAD_REQUESTS}
    valid = result["valid"]
    assert valid.finish == "length"
    assert valid.token_ids == reference
    assert streamed == reference


# ---- the draft and target services directly ------------------------------------------------------


def seq(seq_id: str, keep_len: int, tokens: list[int]) -> mpb.SequenceInput:
    return mpb.SequenceInput(seq_id=seq_id, keep_len=keep_len, tokens=tokens)


def expect(code: grpc.StatusCode, call, *words: str):
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == code, caught.value.details()
    for word in words:
        assert word in caught.value.details()


@pytest.fixture
def target_stub(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.target.port}") as channel:
        yield mpb_grpc.TargetStub(channel)


@pytest.fixture
def draft_stub(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.draft.port}") as channel:
        yield mpb_grpc.DraftStub(channel)


def test_target_service_refusals(stack, target_stub, target_model):
    t = target_stub
    engine = stack.target_engine
    NOT_FOUND, STALE, INVALID = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                                 grpc.StatusCode.INVALID_ARGUMENT)
    verify = lambda *items, create=False: t.Verify(mpb.VerifyRequest(items=list(items), create=create), timeout=10)  # noqa: E731
    item = lambda s, drafts=(): mpb.VerifyItem(sequence=s, draft_tokens=list(drafts))  # noqa: E731

    prompt = [1, 40, 50, 60, 70]
    reply = t.Prefill(mpb.PrefillRequest(sequences=[seq("x", 0, prompt[:-1])]), timeout=10)
    assert [(s.seq_id, s.cached_len) for s in reply.sequences] == [("x", 4)]

    expect(NOT_FOUND, lambda: verify(item(seq("ghost", 0, [1, 5]))), "ghost")
    expect(NOT_FOUND, lambda: verify(item(seq("x", 4, [prompt[-1]])), item(seq("ghost", 0, [5]))), "ghost")
    expect(NOT_FOUND, lambda: t.Rollback(mpb.RollbackRequest(
        sequences=[mpb.SequenceLength(seq_id="ghost", cached_len=0)]), timeout=10), "ghost")
    expect(STALE, lambda: verify(item(seq("x", 9, [5]))), "keep_len=9")
    expect(STALE, lambda: t.Prefill(mpb.PrefillRequest(sequences=[seq("x", 5, [5])]), timeout=10), "keep_len=5")
    expect(NOT_FOUND, lambda: verify(item(seq("new", 3, [5])), create=True), "keep_len 0")
    expect(INVALID, lambda: verify(item(seq("x", 4, [VOCAB]))), "outside")
    expect(INVALID, lambda: verify(item(seq("x", 4, [prompt[-1]]), [5, -1])), "outside")
    expect(INVALID, lambda: t.Prefill(mpb.PrefillRequest(sequences=[seq("y", 0, [1, 1000])]), timeout=10), "outside")
    expect(INVALID, lambda: verify(item(seq("x", 4, [prompt[-1]]), [5] * (CONTEXT - 4))), "at most 16")
    expect(INVALID, lambda: verify(item(seq("x", 4, [prompt[-1]] * (CONTEXT - 8)), [5] * 8)), "context")
    expect(INVALID, lambda: t.Prefill(mpb.PrefillRequest(sequences=[seq("y", 0, [1] * (CONTEXT + 1))]), timeout=10),
           "context")
    leaves = lambda drafts, *at: mpb.VerifyItem(sequence=seq("x", 4, [prompt[-1]]), draft_tokens=drafts,  # noqa: E731
                                                leaves=[mpb.Leaves(tokens=tokens) for tokens in at])
    expect(INVALID, lambda: verify(leaves([5, 6], [7, 7])), "repeat")
    expect(INVALID, lambda: verify(leaves([5, 6], [8, 5])), "repeat")
    expect(INVALID, lambda: verify(leaves([5], [8], [9])), "leaves at 2 positions for 1 drafts")
    expect(INVALID, lambda: verify(leaves([5], [VOCAB])), "outside")
    expect(INVALID, lambda: t.Rollback(mpb.RollbackRequest(
        sequences=[mpb.SequenceLength(seq_id="x", cached_len=7)]), timeout=10), "roll back")
    # A rollback naming one unknown sequence changes none of the others.
    expect(NOT_FOUND, lambda: t.Rollback(mpb.RollbackRequest(sequences=[
        mpb.SequenceLength(seq_id="x", cached_len=2), mpb.SequenceLength(seq_id="ghost", cached_len=0)]), timeout=10))
    assert set(engine.sequences) == {"x"} and engine.length("x") == 4

    # The service still computes the right thing for the sequence it holds.
    reference = greedy_reference(target_model, prompt, 4)
    reply = verify(item(seq("x", 4, [prompt[-1]]), reference[:2] + [wrong(reference[2])]))
    (verdict,) = reply.verdicts
    assert (verdict.seq_id, verdict.accepted, verdict.next_token, verdict.cached_len) == ("x", 2, reference[2], 7)
    t.Rollback(mpb.RollbackRequest(sequences=[mpb.SequenceLength(seq_id="x", cached_len=2)]), timeout=10)
    assert engine.length("x") == 2

    assert t.Release(mpb.ReleaseRequest(seq_ids=["ghost"]), timeout=10).released == 0
    assert t.Release(mpb.ReleaseRequest(seq_ids=["x", "x"]), timeout=10).released == 1
    assert t.Release(mpb.ReleaseRequest(seq_ids=["x"]), timeout=10).released == 0
    assert not engine.sequences
    expect(NOT_FOUND, lambda: verify(item(seq("x", 0, prompt))))


def wrong(token: int) -> int:
    return (token + 1) % VOCAB


def test_draft_service_refusals(stack, draft_stub, draft_model):
    d = draft_stub
    engine = stack.draft_engine
    NOT_FOUND, STALE, INVALID = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                                 grpc.StatusCode.INVALID_ARGUMENT)
    propose = lambda *items: d.Propose(mpb.ProposeRequest(items=list(items)), timeout=10)  # noqa: E731
    item = lambda s, k: mpb.ProposeItem(sequence=s, k=k)  # noqa: E731

    prompt = [1, 11, 22, 33, 44, 55]
    d.Prefill(mpb.PrefillRequest(sequences=[seq("x", 0, prompt[:-1])]), timeout=10)
    assert engine.length("x") == 5

    expect(NOT_FOUND, lambda: d.Rollback(mpb.RollbackRequest(
        sequences=[mpb.SequenceLength(seq_id="ghost", cached_len=0)]), timeout=10), "ghost")
    expect(STALE, lambda: propose(item(seq("x", 6, [5]), 2)), "keep_len=6")
    expect(NOT_FOUND, lambda: propose(item(seq("ghost", 3, [5]), 2)), "keep_len 0")
    expect(STALE, lambda: d.Prefill(mpb.PrefillRequest(sequences=[seq("x", 8, [5])]), timeout=10))
    expect(INVALID, lambda: propose(item(seq("x", 5, [VOCAB + 3]), 2)), "outside")
    expect(INVALID, lambda: propose(item(seq("x", 5, [prompt[-1]]), 0)), "k must be")
    expect(INVALID, lambda: propose(item(seq("x", 5, [prompt[-1]]), 17)), "k must be")
    expect(INVALID, lambda: propose(item(seq("x", 5, [prompt[-1]]), 2), item(seq("x", 5, [prompt[-1]]), 2)), "twice")
    expect(INVALID, lambda: propose(mpb.ProposeItem(sequence=seq("x", 5, [prompt[-1]]), k=2, leaves=[9])), "leaves")
    expect(INVALID, lambda: propose(mpb.ProposeItem(sequence=seq("x", 5, [prompt[-1]]), k=1, leaves=[1, 1])), "leaves")
    assert set(engine.sequences) == {"x"} and engine.length("x") == 5

    reply = propose(item(seq("x", 5, [prompt[-1]]), 4), mpb.ProposeItem(sequence=seq("fresh", 0, prompt), k=2, leaves=[3]))
    reference = greedy_reference(draft_model, prompt, 4)
    assert [(p.seq_id, list(p.tokens), p.cached_len) for p in reply.proposals] == [
        ("x", reference, len(prompt) + 3), ("fresh", reference[:2], len(prompt) + 1)]
    # Leaves: the draft's next most likely tokens after its own at the first position.
    with torch.no_grad():
        ranked = draft_model(torch.tensor([prompt])).logits[0, -1].topk(4).indices.tolist()
    assert [list(at.tokens) for at in reply.proposals[1].leaves] == [ranked[1:]] and ranked[0] == reference[0]

    assert d.Release(mpb.ReleaseRequest(seq_ids=["ghost"]), timeout=10).released == 0
    assert d.Release(mpb.ReleaseRequest(seq_ids=["x", "fresh", "ghost"]), timeout=10).released == 2
    assert d.Release(mpb.ReleaseRequest(seq_ids=["x", "fresh"]), timeout=10).released == 0
    assert not engine.sequences


# ---- Info and health -----------------------------------------------------------------------------


def test_info_reports_the_stack_limits(stack, target_stub, draft_stub):
    info = stack.client().Info(pb.InfoRequest(), timeout=10)
    assert info.max_new_tokens_limit == MAX_NEW_TOKENS
    assert info.max_batch_size == 8
    assert info.max_queue == 256
    assert info.max_context == CONTEXT
    assert info.k_policy == "learn"  # no profile given
    assert (info.target_model, info.draft_model) == ("target", "draft")
    assert info.eos_token_id == -1  # the stack was built with no EOS ids
    assert info.version == __version__
    assert (info.running, info.waiting, info.totals.steps) == (0, 0, 0)
    for stub, model in ((target_stub, "target"), (draft_stub, "draft")):
        stats = stub.CacheStats(mpb.CacheStatsRequest(), timeout=10)
        assert (stats.model, stats.max_sequences, stats.max_context, stats.vocab_size) == (model, 256, CONTEXT, VOCAB)
    generate(stack.client(), make_request(PROMPT, 10, ignore_eos=True), timeout=60)
    totals = stack.client().Info(pb.InfoRequest(), timeout=10).totals
    assert totals.steps > 0 and totals.sequence_steps >= totals.steps


def test_health_reports_serving(stack):
    for port, services in ((stack.coordinator.port, ["", "specbatch.v1.Generation"]),
                           (stack.target.port, ["", "specbatch.v1.Target"]),
                           (stack.draft.port, ["", "specbatch.v1.Draft"])):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in services:
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, (port, service)


def test_prompt_token_limit(target_model, draft_model, tokenizer):
    """--max-prompt-tokens: one token over is INVALID_ARGUMENT, the limit itself is served."""
    stack = start_local_stack(target_model, draft_model, tokenizer, max_prompt_tokens=6)
    try:
        error = refusal(stack.client(), make_request([1, 5, 6, 7, 8, 9, 10], 4))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit is 6" in error.details()
        result = generate(stack.client(), make_request([1, 5, 6, 7, 8, 9], 4, ignore_eos=True), timeout=30)
        assert result.token_ids == greedy_reference(target_model, [1, 5, 6, 7, 8, 9], 4)
    finally:
        stack.stop()


def test_a_10_mb_prompt_is_refused_at_once_and_stalls_no_stream(stack, target_model):
    """A text far past what the context holds is refused on its size, before the tokenizer spends
    seconds on it; while two such prompts and two of the largest size allowed arrive, a running
    stream's tokens keep coming. Bounds are generous: this checks behaviour, not speed."""
    huge = make_request("w7 " * 3_400_000, 8)  # 10 MB, 3.4 M tokens
    largest = make_request(words(CONTEXT - 1), 1, ignore_eos=True)
    arrivals: list[float] = []
    running = {}

    def stream():
        running["result"] = generate(stack.client(), make_request(PROMPT, MAX_NEW_TOKENS, k=0, ignore_eos=True),
                                     on_response=lambda r: arrivals.append(time.monotonic()), timeout=120)

    def send(message):
        start = time.monotonic()
        try:
            result = generate(stack.client(), message, timeout=60)
            return result.finish, time.monotonic() - start
        except grpc.RpcError as error:
            return error.code(), time.monotonic() - start

    # Each target forward takes 20 ms more: the stream's 128 steps outlast the flood.
    with hooked_forwards(stack.target_engine, lambda fed: time.sleep(0.02)):
        streaming = threading.Thread(target=stream)
        streaming.start()
        deadline = time.monotonic() + 30
        while len(arrivals) < 3:
            assert time.monotonic() < deadline, "the stream never started"
            time.sleep(0.005)
        flood_start = time.monotonic()
        with futures.ThreadPoolExecutor(4) as pool:
            outcomes = list(pool.map(send, [huge, largest, huge, largest]))
        flood_end = time.monotonic()
        outlasted = "result" not in running
        streaming.join(timeout=120)
    assert [code for code, _ in outcomes] == [grpc.StatusCode.INVALID_ARGUMENT, "length"] * 2
    refusal_seconds = max(seconds for (code, seconds) in outcomes[::2])
    assert refusal_seconds < 1.0
    assert outlasted, "the stream ended before the flood did: nothing was measured"
    during = [b - a for a, b in pairwise(arrivals) if b >= flood_start and a <= flood_end]
    assert during and max(during) < 1.0
    assert running["result"].token_ids == greedy_reference(target_model, PROMPT, MAX_NEW_TOKENS)
