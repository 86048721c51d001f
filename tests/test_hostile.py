"""A hostile client of the model services and the coordinator: malformed bytes and oversized
messages on every transport (gRPC, and the services' Unix sockets), drawn by hypothesis.

Every answer must be a clear status, never INTERNAL or UNKNOWN; a refused call must change no
state (the sequences each service holds and their lengths); and afterwards a normal request still
decodes exactly as target-only decoding. tests/test_fuzz.py does the same for well-formed client
requests; this file is for what no honest client sends.
"""

from __future__ import annotations

import math
import socket
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from tiny import VOCAB, greedy_reference

from specbatch.protocol.errors import MAX_SEQ_ID_LENGTH
from specbatch.protocol.speculation import MAX_K, MAX_LEAVES
from specbatch.rpc import local
from specbatch.rpc.client import generate, make_request
from specbatch.stack.in_process import start_local_stack
from specbatch.v1 import model_services_pb2 as mpb

NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
CONTEXT = 256  # the tiny models' context
MAX_SEQUENCES = 8
HELD = [1, 17, 42, 9]  # what the services hold for a sequence of an honest coordinator
TARGET, DRAFT, GENERATION = "/specbatch.v1.Target/", "/specbatch.v1.Draft/", "/specbatch.v1.Generation/"


@pytest.fixture(scope="module")
def hostile_stack(target_model, draft_model, tokenizer, tmp_path_factory):
    options = {"max_sequences": MAX_SEQUENCES}
    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=4, max_new_tokens=32,
                              socket_dir=str(tmp_path_factory.mktemp("sockets")), target_engine_options=options,
                              draft_engine_options=options)
    for engine in (stack.target_engine, stack.draft_engine):
        engine.prefill([local_input("held", HELD)])
    yield stack
    stack.stop()


def local_input(seq_id, tokens):
    from specbatch.engine.batch import SequenceInput

    return SequenceInput(seq_id, 0, list(tokens))


def state(stack) -> tuple[dict, dict]:
    """What each service holds: sequence id -> cached length."""
    return tuple({seq_id: cache.length for seq_id, cache in engine.sequences.items()}
                 for engine in (stack.target_engine, stack.draft_engine))


# ---- transports: raw bytes in, (status, details) out ---------------------------------------------


def call_grpc(address: str, method: str, body: bytes) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as channel:
        rpc = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            rpc(body, timeout=10)
        except grpc.RpcError as error:
            return error.code(), error.details() or ""
        return grpc.StatusCode.OK, ""


def call_grpc_stream(address: str, method: str, body: bytes) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as channel:
        rpc = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
        try:
            for _ in rpc(body, timeout=30):
                pass
        except grpc.RpcError as error:
            return error.code(), error.details() or ""
        return grpc.StatusCode.OK, ""


def frame(method: bytes, body: bytes, seconds: float = 10.0) -> bytes:
    return local.REQUEST.pack(len(body), len(method), seconds) + method + body


def read_reply(conn: socket.socket) -> tuple[grpc.StatusCode, str] | None:
    head = local._read(conn, local.REPLY.size)
    if head is None:
        return None
    size, status = local.REPLY.unpack(head)
    data = local._read(conn, size)
    return local.CODES[status], (data or b"").decode(errors="replace") if status else ""


def call_local(path: str, method: bytes, body: bytes, seconds: float = 10.0) -> tuple[grpc.StatusCode, str]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(path)
        conn.sendall(frame(method, body, seconds))
        reply = read_reply(conn)
    assert reply is not None, "the service closed the connection instead of answering"
    return reply


# ---- hostile messages ----------------------------------------------------------------------------


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (a string, bytes or a message)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


BAD_UTF8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"ok\xf0\x28\x8c\x28", b"\x80" * 3])
far_id = st.one_of(st.integers(-(2**31), -1), st.integers(VOCAB, 2**31 - 1))
good_id = st.integers(0, VOCAB - 1)
hostile_id = st.one_of(st.just(""), st.text(min_size=MAX_SEQ_ID_LENGTH + 1, max_size=MAX_SEQ_ID_LENGTH + 50),
                       st.sampled_from(["ghost", "new"]))


def seq(seq_id="held", keep_len=len(HELD), tokens=(5,), features=b"") -> mpb.SequenceInput:
    return mpb.SequenceInput(seq_id=seq_id, keep_len=keep_len, tokens=list(tokens), features=features)


SEQUENCE_DEFECTS = ("token", "seq id", "keep_len")


def spoil_sequence(draw, defect: str, sequence: mpb.SequenceInput) -> None:
    """A defect of the sequence a Verify or Propose item names: a token far outside the
    vocabulary, a hostile id, or more kept tokens than the service holds."""
    if defect == "token":
        sequence.tokens.append(draw(far_id))
    elif defect == "seq id":
        sequence.seq_id = draw(hostile_id)
    else:
        sequence.keep_len = draw(st.integers(len(HELD) + 1, 2**32 - 1))


@st.composite
def hostile_verify(draw) -> bytes:
    """A Verify wrong in at least one way the target must refuse before it computes."""
    defect = draw(st.sampled_from(["drafts", "leaves", "leaf positions", "token", "seq id", "keep_len", "rows",
                                   "twice", "sampling", "distributions", "context"]))
    item = mpb.VerifyItem(sequence=seq(), draft_tokens=draw(st.lists(good_id, max_size=4)))
    items = [item]
    if defect == "drafts":
        item.draft_tokens[:] = draw(st.lists(good_id, min_size=MAX_K + 1, max_size=8 * MAX_K))
    elif defect == "leaves":
        item.draft_tokens[:] = [3, 4]
        item.leaves.append(mpb.Leaves(tokens=list(range(5, 5 + draw(st.integers(MAX_LEAVES + 1, 2000))))))
    elif defect == "leaf positions":
        item.leaves.extend(mpb.Leaves(tokens=[9]) for _ in range(len(item.draft_tokens) + draw(st.integers(1, 40))))
    elif defect in SEQUENCE_DEFECTS:
        spoil_sequence(draw, defect, item.sequence)
    elif defect == "rows":
        items += [mpb.VerifyItem(sequence=seq(f"r{i}", 0, [1])) for i in range(MAX_SEQUENCES + draw(st.integers(0, 50)))]
    elif defect == "twice":
        items.append(mpb.VerifyItem(sequence=seq()))
    elif defect == "sampling":
        item.sampling.temperature = draw(st.sampled_from([math.nan, -1.0, math.inf]))
    elif defect == "distributions":
        item.draft_tokens[:] = [3]
        item.sampling.temperature = 0.8
        item.draft_distributions.append(mpb.DraftDistribution(
            token_ids=draw(st.lists(st.one_of(good_id, far_id), max_size=40)),
            probs=draw(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=40))))
    else:
        item.sequence.tokens[:] = [5] * (CONTEXT - len(HELD))
        item.draft_tokens[:] = [6]
    return mpb.VerifyRequest(items=items, create=draw(st.booleans()) and defect != "rows",
                             return_features=draw(st.booleans())).SerializeToString()


@st.composite
def hostile_propose(draw) -> bytes:
    defect = draw(st.sampled_from(["k", "leaves", "token", "seq id", "keep_len", "rows", "sampling", "features"]))
    item = mpb.ProposeItem(sequence=seq(), k=2)
    items = [item]
    if defect == "k":
        item.k = draw(st.one_of(st.just(0), st.integers(MAX_K + 1, 2**32 - 1)))
    elif defect == "leaves":
        item.leaves[:] = draw(st.one_of(st.lists(st.integers(0, 2), min_size=3, max_size=100),
                                        st.lists(st.integers(MAX_LEAVES + 1, 2**32 - 1), min_size=1, max_size=2)))
    elif defect in SEQUENCE_DEFECTS:
        spoil_sequence(draw, defect, item.sequence)
    elif defect == "rows":
        items += [mpb.ProposeItem(sequence=seq(f"r{i}", 0, [1]), k=1) for i in range(MAX_SEQUENCES)]
    elif defect == "sampling":
        item.sampling.top_p = draw(st.sampled_from([0.0, -0.5, 1.5, math.nan]))
        item.sampling.temperature = 0.7
    else:  # this draft reads no features: they must be ignored or refused, never crash it
        item.sequence.features = draw(st.binary(min_size=1, max_size=64))
        item.sequence.tokens.append(draw(far_id))
    return mpb.ProposeRequest(items=items).SerializeToString()


@st.composite
def hostile_cache_call(draw) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["Prefill", "Rollback", "Release"]))
    if kind == "Prefill":
        defect = draw(st.sampled_from(["context", "empty", "seq id", "twice", "capacity", "token"]))
        sequences = {
            "context": [seq("new", 0, [1] * draw(st.integers(CONTEXT + 1, 4 * CONTEXT)))],
            "empty": [seq("new", 0, [])],
            "seq id": [seq(draw(hostile_id.filter(lambda s: s not in ("ghost", "new"))), 0, [1])],
            "twice": [seq("new", 0, [1]), seq("new", 0, [2])],
            "capacity": [seq(f"c{i}", 0, [1]) for i in range(MAX_SEQUENCES + draw(st.integers(0, 30)))],
            "token": [seq("new", 0, [1, draw(far_id)])],
        }[defect]
        return kind, mpb.PrefillRequest(sequences=sequences).SerializeToString()
    if kind == "Rollback":
        cached_len = draw(st.integers(len(HELD) + 1, 2**32 - 1))
        return kind, mpb.RollbackRequest(sequences=[
            mpb.SequenceLength(seq_id="held", cached_len=len(HELD) - 1),  # named first: it must not move
            mpb.SequenceLength(seq_id=draw(st.sampled_from(["held", "ghost"])), cached_len=cached_len)]).SerializeToString()
    return kind, mpb.ReleaseRequest(seq_ids=draw(st.lists(hostile_id, max_size=20))).SerializeToString()


@st.composite
def malformed_bytes(draw, valid: bytes) -> bytes:
    """Bytes that are not a message: truncated, a string that is not UTF-8, a corrupt wire type,
    or noise."""
    how = draw(st.sampled_from(["truncated", "utf8", "wire", "noise"]))
    if how == "truncated" and len(valid) > 1:
        return valid[: draw(st.integers(1, len(valid) - 1))]
    if how == "utf8":  # field 1 of every request here is a string or holds one first
        bad = draw(BAD_UTF8)
        return field(1, field(1, bad)) if draw(st.booleans()) else field(1, bad)
    if how == "wire":
        return b"\x0f" + draw(st.binary(max_size=16))  # field 1 with wire type 7: no such type
    return draw(st.binary(min_size=1, max_size=200))


VALID = {
    "Verify": mpb.VerifyRequest(items=[mpb.VerifyItem(sequence=seq(), draft_tokens=[3, 4])]).SerializeToString(),
    "Propose": mpb.ProposeRequest(items=[mpb.ProposeItem(sequence=seq(), k=2)]).SerializeToString(),
    "Prefill": mpb.PrefillRequest(sequences=[seq("new", 0, [1, 2])]).SerializeToString(),
}


@st.composite
def hostile_call(draw) -> tuple[str, str, bytes]:
    """(service, method, body) for one of the model services."""
    service = draw(st.sampled_from(["target", "draft"]))
    choice = draw(st.sampled_from(["own", "cache", "bytes"]))
    if choice == "own":
        return (service, "Verify", draw(hostile_verify())) if service == "target" else \
               (service, "Propose", draw(hostile_propose()))
    if choice == "cache":
        return (service, *draw(hostile_cache_call()))
    method = draw(st.sampled_from(["Prefill", "Verify" if service == "target" else "Propose", "Rollback", "Release"]))
    return service, method, draw(malformed_bytes(VALID.get(method, b"\x0a\x01x")))


@st.composite
def hostile_generate(draw) -> bytes:
    """A client request the coordinator cannot parse."""
    valid = make_request([1, 17, 42], 4).SerializeToString()
    how = draw(st.sampled_from(["stop", "text", "request id", "bytes"]))
    if how == "stop":  # a stop string that is not UTF-8, after a valid request
        return valid + field(5, draw(BAD_UTF8))
    if how == "text":
        return field(1, b"hello " + draw(BAD_UTF8)) + b"\x20\x04"  # max_new_tokens = 4
    if how == "request id":
        return valid + field(10, draw(BAD_UTF8))
    return draw(malformed_bytes(valid))


# ---- the hostile client --------------------------------------------------------------------------


EXAMPLES = 200


def test_hostile_calls_get_clear_statuses_and_change_nothing(hostile_stack, target_model):
    """≥ 80 hostile inputs over both transports and the coordinator: none answered INTERNAL or
    UNKNOWN, none leaving state behind; then a normal request is still exact."""
    stack = hostile_stack
    before = state(stack)
    seen: dict[str, int] = {}
    servers = {"target": stack.target, "draft": stack.draft}

    @seed(11)
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=False, database=None,
              suppress_health_check=list(HealthCheck))
    @given(call=st.one_of(hostile_call(), hostile_call(), hostile_generate().map(lambda body: ("coordinator", "Generate", body))),
           over_socket=st.booleans())
    def one(call, over_socket):
        service, method, body = call
        if service == "coordinator":
            status, details = call_grpc_stream(stack.address, GENERATION + method, body)
            transport = "grpc"
        else:
            full = (TARGET if service == "target" else DRAFT) + method
            if over_socket:
                status, details = call_local(servers[service].local.path, full.encode(), body)
                transport = "socket"
            else:
                status, details = call_grpc(f"127.0.0.1:{servers[service].port}", full, body)
                transport = "grpc"
        assert status not in NEVER, f"{service}.{method} over {transport}: {status.name}: {details}"
        after = state(stack)
        if status != grpc.StatusCode.OK or method == "Release":
            assert after == before, f"{service}.{method} over {transport} answered {status.name} and changed state"
        else:  # noise that happens to be a valid call (a Prefill of a new sequence): undo it
            for engine in (stack.target_engine, stack.draft_engine):
                engine.run(engine.release, [s for s in engine.sequences if s != "held"])
        seen[status.name] = seen.get(status.name, 0) + 1

    one()
    assert sum(seen.values()) >= 80
    assert seen.get("INVALID_ARGUMENT", 0) >= 80, seen
    assert state(stack) == before

    prompt = [1, 17, 42, 9, 33]
    result = generate(stack.client(), make_request(prompt, 16, k=3))
    assert list(result.token_ids) == greedy_reference(target_model, prompt, 16)


@pytest.mark.parametrize("over_socket", [False, True])
def test_an_over_bound_verify_is_refused_before_it_waits_for_the_model(hostile_stack, over_socket):
    """Thousands of leaves would hold the model thread for seconds: the refusal comes while the
    model is busy (its lock held here), so it never waited for it."""
    stack = hostile_stack
    body = mpb.VerifyRequest(items=[mpb.VerifyItem(sequence=seq(), draft_tokens=[3, 4], leaves=[
        mpb.Leaves(tokens=list(range(5, 5 + 8000)))])]).SerializeToString()
    with stack.target_engine.lock:
        if over_socket:
            status, details = call_local(stack.target.local.path, (TARGET + "Verify").encode(), body, seconds=5)
        else:
            status, details = call_grpc(f"127.0.0.1:{stack.target.port}", TARGET + "Verify", body)
    assert status == grpc.StatusCode.INVALID_ARGUMENT and f"at most {MAX_LEAVES}" in details


def test_the_unix_socket_serves_a_bounded_number_of_connections(hostile_stack):
    """Connections past ``MAX_CONNECTIONS`` are closed at once (their client uses gRPC instead),
    so idle connections cannot pile up threads; a call still gets through once they go."""
    path = hostile_stack.target.local.path
    held = []
    try:
        for _ in range(local.MAX_CONNECTIONS + 20):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(10)
            conn.connect(path)
            held.append(conn)
        # The server takes connections in order: once the last reads as closed, each one before
        # it is either served by a thread or closed too.
        assert held[-1].recv(1) == b""
        closed = []
        for conn in held:
            conn.setblocking(False)
            try:
                closed.append(conn.recv(1) == b"")
            except BlockingIOError:  # open, waiting for a call
                closed.append(False)
        assert sum(closed) >= 20 and len(held) - sum(closed) <= local.MAX_CONNECTIONS
        assert not any(closed[: local.MAX_CONNECTIONS - 8])  # (the coordinator holds a few of its own)
    finally:
        for conn in held:
            conn.close()
    deadline = time.monotonic() + 10
    while True:  # the closed connections' threads end as they read EOF
        try:
            status, _ = call_local(path, (TARGET + "CacheStats").encode(), b"")
            break
        except (AssertionError, ConnectionResetError, BrokenPipeError):
            # Still over the limit: closed at once, read as an end of file, or as a reset where the
            # server closed it with the call unread (which of the two is a race).
            assert time.monotonic() < deadline
    assert status == grpc.StatusCode.OK


def test_a_frame_naming_no_method_is_answered_and_the_connection_serves_on(hostile_stack):
    """A method name that is not UTF-8, or names nothing, gets UNIMPLEMENTED (as gRPC answers it),
    a body that does not parse INVALID_ARGUMENT, and the same connection serves the next call."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(hostile_stack.target.local.path)
        for method, body, expected in [(b"\xff\xfe/x", b"", grpc.StatusCode.UNIMPLEMENTED),
                                       (b"/specbatch.v1.Target/Nothing", b"", grpc.StatusCode.UNIMPLEMENTED),
                                       ((TARGET + "Verify").encode(), b"\x0a\x05\x0a\x03\xff\xfe", grpc.StatusCode.INVALID_ARGUMENT),
                                       ((TARGET + "CacheStats").encode(), b"", grpc.StatusCode.OK)]:
            conn.sendall(frame(method, body, seconds=math.nan))
            status, details = read_reply(conn)
            assert status == expected, details


def test_a_failed_call_leaves_no_sequence_it_created(target_model):
    """A forward that fails after the call created its sequences (a fault, not a refusal) releases
    them: none holds a slot that nobody owns."""
    from specbatch.engine.engine import Engine

    engine = Engine(target_model, max_sequences=4)
    engine.prefill([local_input("kept", [1, 2, 3])])

    def fails():
        engine.start([local_input("new", [1, 2])], create=True)
        raise RuntimeError("a forward failed")

    with pytest.raises(RuntimeError):
        engine.run(fails)
    assert {s: c.length for s, c in engine.sequences.items()} == {"kept": 3}


def test_features_cross_the_wire_finite():
    """A hidden state past float16's range is sent as its largest value, not inf: the draft
    refuses features that are not finite, so the target must never send any."""
    import numpy as np
    import torch

    from specbatch.service.servicer import features_from_bytes, features_to_bytes

    data = features_to_bytes(torch.tensor([[1e6, -1e6, 0.5]]))
    assert np.isfinite(np.frombuffer(data, dtype="<f2")).all()
    assert features_from_bytes("s", data, 3).tolist() == [[65504.0, -65504.0, 0.5]]
    # A Verify's features are float16 on the host already: sent as they are, an inf as the largest.
    assert features_to_bytes(torch.tensor([[1e6, -1e6, 0.5]]).to(torch.float16)) == data
