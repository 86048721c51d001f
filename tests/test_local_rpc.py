"""The services' calls over Unix sockets (specbatch/rpc/local.py): the same results and statuses as
through gRPC, and back to gRPC where a socket fails."""

import os
import stat

import grpc
import pytest

from specbatch.rpc.local import LocalChannel, LocalRpcError, LocalServer
from specbatch.v1 import model_services_pb2 as pb
from specbatch.v1 import model_services_pb2_grpc as pb_grpc
from tests.tiny import greedy_mixed_batch, greedy_reference, random_prompts


@pytest.fixture
def socket_stack(target_model, draft_model, tokenizer, tmp_path):
    from specbatch.stack.in_process import start_local_stack

    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8, max_new_tokens=128,
                              socket_dir=str(tmp_path))
    yield stack
    stack.stop()


def counted(server: LocalServer) -> list[str]:
    """The methods ``server`` serves from now on, as they come."""
    calls, handle = [], server._handle

    def counting(name, body, seconds_left):
        calls.append(name.rsplit("/", 1)[-1])
        return handle(name, body, seconds_left)

    server._handle = counting
    return calls


def clients(stack):
    return [r.client for r in stack.coordinator.targets.replicas.values()] + \
           [r.client for r in stack.coordinator.drafts.replicas.values()]


def test_a_stack_on_local_sockets_decodes_as_target_only_decoding(socket_stack, target_model):
    """The coordinator finds each service's socket in its CacheStats and sends Propose and Verify
    there; the tokens are target-only greedy decoding's, six requests batched together."""
    target_calls, draft_calls = counted(socket_stack.target.local), counted(socket_stack.draft.local)
    results = greedy_mixed_batch(socket_stack, seed=3, k=3)
    for prompt, result in zip(random_prompts(3), results):
        assert list(result.token_ids) == greedy_reference(target_model, prompt, 30)
    assert "Verify" in target_calls and "Propose" in draft_calls
    assert all(client.local is not None for client in clients(socket_stack))
    mode = os.stat(socket_stack.target.local.path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600  # its owner's alone: it skips TLS


def test_a_refusal_keeps_its_status_and_message_locally(socket_stack):
    """A Verify of a sequence the target does not hold: NOT_FOUND with the engine's message, the
    same over the socket as through gRPC; the connection serves the next call."""
    request = pb.VerifyRequest(items=[pb.VerifyItem(sequence=pb.SequenceInput(seq_id="ghost", keep_len=4, tokens=[8]))])
    with grpc.insecure_channel(f"127.0.0.1:{socket_stack.target.port}") as channel:
        with pytest.raises(grpc.RpcError) as through_grpc:
            pb_grpc.TargetStub(channel).Verify(request, timeout=10)
    local = LocalChannel(socket_stack.target.local.path)
    with pytest.raises(LocalRpcError) as locally:
        local.call("/specbatch.v1.Target/Verify", request, 10.0)
    assert locally.value.code() == through_grpc.value.code() == grpc.StatusCode.NOT_FOUND
    assert locally.value.details() == through_grpc.value.details()
    stats = local.call("/specbatch.v1.Target/CacheStats", pb.CacheStatsRequest(), 10.0)
    assert stats.local_socket == socket_stack.target.local.path
    with pytest.raises(LocalRpcError) as unknown:
        local.call("/specbatch.v1.Target/Nothing", request, 10.0)
    assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    local.close()


def test_a_lost_socket_sends_the_calls_back_to_grpc(socket_stack, target_model):
    """The target's socket goes away between two requests: the next call fails over it, the
    client drops it, and the retry goes through gRPC; nothing is lost."""
    prompt = random_prompts(5, 1)[0]
    expected = greedy_reference(target_model, prompt, 30)
    first = greedy_mixed_batch(socket_stack, seed=5, k=2, prompts=1)
    socket_stack.target.local.stop()
    second = greedy_mixed_batch(socket_stack, seed=5, k=2, prompts=1)
    assert list(first[0].token_ids) == list(second[0].token_ids) == expected
    (target,) = socket_stack.coordinator.targets.replicas.values()
    assert target.client.local is None
    # A CacheStats that names no socket (or one not on this host) leaves gRPC in place.
    target.client.cache_stats()
    assert target.client.local is None


def test_no_socket_is_named_without_one(stack):
    (target,) = stack.coordinator.targets.replicas.values()
    assert target.client.cache_stats().local_socket == "" and target.client.local is None


def test_a_request_over_the_message_cap_is_refused_as_grpc_refuses_it(socket_stack, monkeypatch):
    """RESOURCE_EXHAUSTED, as gRPC's 64 MiB cap answers (the cap lowered here to a few bytes); the
    service goes on serving other connections."""
    from specbatch.rpc import local as local_rpc

    monkeypatch.setattr(local_rpc, "MAX_MESSAGE_BYTES", 16)
    local = LocalChannel(socket_stack.target.local.path)
    big = pb.ReleaseRequest(seq_ids=["x" * 64])
    with pytest.raises(LocalRpcError) as refused:
        local.call("/specbatch.v1.Target/Release", big, 10.0)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert local.call("/specbatch.v1.Target/Release", pb.ReleaseRequest(), 10.0).released == 0
    local.close()


@pytest.mark.parametrize("on_a_loop", [False, True], ids=["thread per connection", "model thread"])
def test_a_call_in_flight_replies_when_the_socket_stops(tmp_path, on_a_loop):
    """Stopping (a draining service) closes the idle connections at once, but a call already
    running sends its reply first, as gRPC's graceful stop lets it; then the socket is gone. The
    same where one thread (an engine's ModelThread) serves every connection."""
    import threading

    from specbatch.engine.model_thread import ModelThread

    started, release = threading.Event(), threading.Event()

    class Slow:
        def CacheStats(self, request, context):
            started.set()
            release.wait(10)
            return pb.CacheStatsResponse(model="slow")

        def Release(self, request, context):
            return pb.ReleaseResponse(released=len(request.seq_ids))

    server = LocalServer(tmp_path, "slow", loop=ModelThread() if on_a_loop else None)
    server.add(Slow(), "specbatch.v1.Target")
    server.start()
    busy, idle = LocalChannel(server.path), LocalChannel(server.path)
    assert idle.call("/specbatch.v1.Target/Release", pb.ReleaseRequest(seq_ids=["a"]), 10.0).released == 1
    replies = []
    caller = threading.Thread(target=lambda: replies.append(
        busy.call("/specbatch.v1.Target/CacheStats", pb.CacheStatsRequest(), 10.0)))
    caller.start()
    assert started.wait(10)
    server.stop()
    with pytest.raises(LocalRpcError) as closed:  # its connection was idle: closed at once
        idle.call("/specbatch.v1.Target/Release", pb.ReleaseRequest(), 10.0)
    assert closed.value.code() == grpc.StatusCode.UNAVAILABLE
    release.set()
    caller.join(10)
    assert [reply.model for reply in replies] == ["slow"]
    with pytest.raises(LocalRpcError) as gone:
        busy.call("/specbatch.v1.Target/CacheStats", pb.CacheStatsRequest(), 10.0)
    assert gone.value.code() == grpc.StatusCode.UNAVAILABLE


def test_local_calls_run_on_the_model_thread_with_no_hand_over(socket_stack):
    """A call on the local socket is read, run and answered by the engine's model thread itself
    (two fewer thread wake-ups a call); a call through gRPC is handed to that thread."""
    import threading

    engine = socket_stack.target_engines[0]
    seen, handle = [], socket_stack.target.local._handle

    def recording(name, body, seconds_left):
        seen.append(threading.current_thread())
        return handle(name, body, seconds_left)

    socket_stack.target.local._handle = recording
    local = LocalChannel(socket_stack.target.local.path)
    assert local.call("/specbatch.v1.Target/Release", pb.ReleaseRequest(seq_ids=["nobody"]), 10.0).released == 0
    assert engine.model_thread.on_thread() is False
    assert seen and all(thread is engine.model_thread._thread for thread in seen)
    ran_on = engine.run(threading.current_thread)  # from here: handed over
    assert ran_on is engine.model_thread._thread
    local.close()


def test_a_peer_stalled_mid_frame_loses_its_connection_and_holds_the_model_thread_briefly(tmp_path, monkeypatch):
    """Where the model thread serves the socket, a peer that sends part of a frame and stalls holds
    it for at most FRAME_SECONDS: then its connection is dropped, and the others' calls go on."""
    import socket
    import time

    from specbatch.engine.model_thread import ModelThread
    from specbatch.rpc import local as local_rpc

    monkeypatch.setattr(local_rpc, "FRAME_SECONDS", 0.3)

    class Releasing:
        def Release(self, request, context):
            return pb.ReleaseResponse(released=len(request.seq_ids))

    loop = ModelThread()
    server = LocalServer(tmp_path, "stall", loop=loop)
    server.add(Releasing(), "specbatch.v1.Target")
    server.start()
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.connect(server.path)
    stalled.sendall(b"\x05\x00")  # two bytes of a header, then nothing
    other = LocalChannel(server.path)
    started = time.monotonic()
    assert other.call("/specbatch.v1.Target/Release", pb.ReleaseRequest(seq_ids=["a", "b"]), 10.0).released == 2
    assert time.monotonic() - started < 5.0
    stalled.settimeout(5.0)
    assert stalled.recv(16) == b""  # dropped
    assert loop.submit(lambda: "the model thread goes on").result(5) == "the model thread goes on"
    stalled.close()
    other.close()
    server.stop()
