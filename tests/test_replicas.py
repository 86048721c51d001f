"""Replicas and faults, in one process: placement and affinity, failover, a draft that is down or
too slow, client deadlines, and draining. Every request must still match target-only decoding."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from test_exactness import prompts_of_lengths
from tiny import greedy_reference

from coordinator.replicas import resolve
from coordinator.services import call_timeout
from draft_service.servicer import DraftServicer
from specbatch.config.speculation import SpeculationConfig
from specbatch.engine.engine import Engine
from specbatch.rpc.client import generate, generate_all, make_request
from specbatch.stack.in_process import serve_engine, start_local_stack
from specbatch.v1 import generation_pb2 as gen_pb
from target_service.servicer import TargetServicer


def info(stack) -> gen_pb.InfoResponse:
    return stack.client().Info(gen_pb.InfoRequest(), timeout=10)


def wait_for(condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def slow_down(engine, seconds: float) -> None:
    """Every call on this engine takes ``seconds`` longer (a slow or overloaded service)."""
    original = engine.start

    def slow_start(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    engine.start = slow_start


def run_in_background(stack, prompts, new_tokens, k=3):
    requests = [make_request(p, new_tokens, k=k, ignore_eos=True) for p in prompts]
    return futures.ThreadPoolExecutor(1).submit(generate_all, stack.client(), requests, None, 120)


def assert_exact(results, prompts, target_model, new_tokens) -> None:
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_reference(target_model, prompt, new_tokens)


def test_endpoints_static_and_dns():
    assert resolve("a:1, b:2,") == ["a:1", "b:2"]
    assert "127.0.0.1:5000" in resolve("dns:localhost:5000")
    assert "127.0.0.1:5000" in resolve("dns:///localhost:5000")
    with pytest.raises(ValueError):
        resolve("dns:localhost")


@pytest.mark.parametrize("marked_down", [False, True])
def test_a_starting_replica_is_probed_often_a_failed_one_with_growing_backoff(marked_down):
    """A replica that has not served yet is most likely loading its model: probed at most 0.5 s
    apart, it joins soon after it serves. One that was marked down backs off to 5 s."""
    from coordinator.replicas import JOINING_PROBE_SECONDS, Replica, ReplicaSet

    class Starting(ReplicaSet):
        probes = 0

        def probe(self, replica):
            self.probes += 1
            if self.probes <= 8:
                raise RuntimeError("not serving yet")

    replicas = Starting("target", "127.0.0.1:1", make_client=lambda address: None)
    replica = Replica("target", "127.0.0.1:1", None, failures=int(marked_down))
    waits = []
    replicas.closed.wait = lambda seconds: waits.append(seconds) or False  # the prober's sleep, recorded
    replicas._probe_until_healthy(replica, cooldown=0.0)
    assert replica.healthy and replicas.probes == 9
    waits = waits[1:]  # the first is the cooldown
    assert len(waits) == 8 and waits == sorted(waits)
    if marked_down:
        assert waits[-1] == 5.0
    else:
        assert max(waits) == JOINING_PROBE_SECONDS


def test_sequences_stay_on_their_replicas_and_spread(target_model, draft_model, tokenizer):
    """2 targets + 2 drafts: 8 requests split over both; each sequence is created on exactly one
    target and one draft replica (never moved), and the output is exact."""
    stack = start_local_stack(target_model, draft_model, tokenizer, target_replicas=2, draft_replicas=2,
                              max_batch_size=8)
    try:
        prompts = prompts_of_lengths([5, 9, 13, 7, 11, 6, 8, 10], seed=3)
        results = run_in_background(stack, prompts, 40).result()
        assert_exact(results, prompts, target_model, 40)
        for engines in (stack.target_engines, stack.draft_engines):
            created = [e.sequences_created for e in engines]
            assert sum(created) == len(prompts), created  # no sequence placed twice
            assert min(created) >= 2, created  # balanced: both replicas took a share
            assert all(not e.sequences for e in engines)  # all released
        assert {r.address for r in info(stack).replicas if r.healthy} == {
            f"127.0.0.1:{s.port}" for s in stack.targets + stack.drafts}
    finally:
        stack.stop()


def test_target_replica_stopped_mid_run_moves_its_sequences(target_model, draft_model, tokenizer, caplog):
    stack = start_local_stack(target_model, draft_model, tokenizer, target_replicas=2, max_batch_size=8)
    caplog.set_level("INFO", logger="coordinator")
    try:
        prompts = prompts_of_lengths([5, 9, 13, 7, 11, 6, 8, 10], seed=5)
        running = run_in_background(stack, prompts, 120)
        wait_for(lambda: info(stack).totals.steps > 10, what="steps")
        stack.targets[1].stop(grace=0)
        results = running.result()
        assert_exact(results, prompts, target_model, 120)
        created = [e.sequences_created for e in stack.target_engines]
        assert created[1] >= 1 and sum(created) > len(prompts)  # the stopped one's sequences moved
        status = {r.address: r for r in info(stack).replicas if r.service == "target"}
        stopped = status[f"127.0.0.1:{stack.targets[1].port}"]
        assert not stopped.healthy and stopped.failures == 1 and stopped.sequences == 0
        registry = stack.coordinator.scheduler.metrics.registry
        assert registry.get_sample_value("specbatch_replica_failovers_total", {"service": "target"}) >= 1
        # Each move is logged with the request's and the sequence's ids (fields of JSON logs).
        moves = [r for r in caplog.records if r.getMessage().startswith("moving off target replica")]
        assert moves and all(r.request_id and r.seq_id for r in moves)
        assert registry.get_sample_value("specbatch_replica_up", {"service": "target", "address": stopped.address}) == 0
    finally:
        stack.stop()


def restart_on(port: int, model, servicer, name: str) -> tuple:
    """A fresh service (empty caches) on the address a stopped one had, serving ``name``."""
    engine = Engine(model)
    deadline = time.monotonic() + 10
    while True:
        try:
            return serve_engine(engine, servicer.serve_on, name, f"127.0.0.1:{port}"), engine
        except RuntimeError:  # the old socket is still closing
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_only_target_down_then_back_costs_time_not_requests(target_model, draft_model, tokenizer):
    """The only target stops mid-run: requests wait (no errors); a fresh one on the same port
    (empty caches) takes them on, rebuilt from the coordinator's history."""
    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8)
    try:
        prompts = prompts_of_lengths([5, 9, 13, 7, 11, 6, 8, 10], seed=7)
        running = run_in_background(stack, prompts, 100)
        wait_for(lambda: info(stack).totals.steps > 10, what="steps")
        port = stack.target.port
        stack.target.stop(grace=0)
        time.sleep(1.0)
        assert not running.done()  # waiting, not failed
        server, engine = restart_on(port, target_model, TargetServicer, "target")
        stack.targets[0], stack.target_engines[0] = server, engine
        assert_exact(running.result(), prompts, target_model, 100)
        assert engine.sequences_created == len(prompts)
    finally:
        stack.stop()


def test_draft_down_runs_target_only_and_resumes(target_model, draft_model, tokenizer):
    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8)
    try:
        prompts = prompts_of_lengths([5, 9, 13, 7, 11, 6, 8, 10], seed=9)
        running = run_in_background(stack, prompts, 150)
        wait_for(lambda: info(stack).totals.steps > 5, what="steps")
        port = stack.draft.port
        stack.draft.stop(grace=0)
        wait_for(lambda: info(stack).totals.k_histogram[0] > 8, what="target-only steps")
        registry = stack.coordinator.scheduler.metrics.registry
        assert registry.get_sample_value("specbatch_draft_fallback_steps_total") > 0
        server, engine = restart_on(port, stack.draft_engine.model, DraftServicer, "draft")
        stack.drafts[0], stack.draft_engines[0] = server, engine
        assert_exact(running.result(), prompts, target_model, 150)
        # The probes find the new draft (within about 6 s: docs/operations.md) and speculation resumes on it.
        wait_for(lambda: all(r.healthy for r in info(stack).replicas), what="the draft back")
        result = generate(stack.client(), make_request(prompts[0], 30, k=3, ignore_eos=True), timeout=30)
        assert result.token_ids == greedy_reference(target_model, prompts[0], 30)
        assert result.stats.draft_tokens_proposed > 0 and engine.sequences_created > 0
    finally:
        stack.stop()


def replica_status(stack, service: str, port: int) -> gen_pb.ReplicaStatus:
    (status,) = [r for r in info(stack).replicas if r.service == service and r.address == f"127.0.0.1:{port}"]
    return status


def test_an_unused_draft_that_stops_is_reported_down_and_used_again_when_back(target_model, draft_model,
                                                                              tokenizer):
    """Under k = 0 no call reaches the draft, so no failed call finds it down: the watcher's
    health checks do, Info says so, and once it serves again requests speculate on it again."""
    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8,
                              speculation=SpeculationConfig(k_policy="fixed:0", prompt_lookup=0))
    try:
        prompts = prompts_of_lengths([5, 9], seed=13)
        results = generate_all(stack.client(), [make_request(p, 20, ignore_eos=True) for p in prompts], timeout=60)
        assert_exact(results, prompts, target_model, 20)
        assert all(r.stats.draft_tokens_proposed == 0 for r in results)
        port = stack.draft.port
        stack.draft.stop(grace=0)
        wait_for(lambda: not replica_status(stack, "draft", port).healthy, timeout=10, what="Info: the draft down")
        assert replica_status(stack, "draft", port).failures == 1
        results = generate_all(stack.client(), [make_request(p, 20, ignore_eos=True) for p in prompts], timeout=60)
        assert_exact(results, prompts, target_model, 20)
        server, engine = restart_on(port, stack.draft_engine.model, DraftServicer, "draft")
        stack.drafts[0], stack.draft_engines[0] = server, engine
        wait_for(lambda: replica_status(stack, "draft", port).healthy, what="Info: the draft back")
        result = generate(stack.client(), make_request(prompts[0], 30, k=3, ignore_eos=True), timeout=30)
        assert result.token_ids == greedy_reference(target_model, prompts[0], 30)
        assert result.stats.draft_tokens_proposed > 0 and engine.sequences_created > 0
    finally:
        stack.stop()


def test_an_idle_target_replica_that_stops_is_reported_down(target_model, draft_model, tokenizer):
    stack = start_local_stack(target_model, draft_model, tokenizer, target_replicas=2)
    try:
        port = stack.targets[1].port
        assert replica_status(stack, "target", port).healthy
        stack.targets[1].stop(grace=0)
        wait_for(lambda: not replica_status(stack, "target", port).healthy, timeout=10, what="Info: the target down")
        prompt = prompts_of_lengths([6], seed=14)[0]
        result = generate(stack.client(), make_request(prompt, 20, k=3, ignore_eos=True), timeout=30)
        assert result.token_ids == greedy_reference(target_model, prompt, 20)
    finally:
        stack.stop()


def test_slow_draft_is_set_aside(target_model, draft_model, tokenizer):
    """A draft slower than --draft-timeout: steps go on target-only rather than waiting for it."""
    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8, draft_timeout=0.3)
    try:
        slow_down(stack.draft_engine, 1.0)
        prompts = prompts_of_lengths([5, 9, 13], seed=11)
        started = time.monotonic()
        results = run_in_background(stack, prompts, 60).result()
        assert_exact(results, prompts, target_model, 60)
        draft = next(r for r in info(stack).replicas if r.service == "draft")
        assert draft.failures >= 1
        # Had every step waited for the draft, 60 steps would take a minute.
        assert time.monotonic() - started < 20
    finally:
        stack.stop()


def test_client_deadline_ends_request_and_frees_caches(target_model, draft_model, tokenizer):
    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8)
    try:
        slow_down(stack.target_engine, 0.05)  # about 20 steps a second: 200 tokens take ~10 s
        prompt = prompts_of_lengths([6])[0]
        with pytest.raises(grpc.RpcError) as raised:
            generate(stack.client(), make_request(prompt, 200, k=0, ignore_eos=True), timeout=1.0)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: not stack.target_engine.sequences and not stack.draft_engine.sequences, 10, "release")
        # A request with time to spare still runs exactly, alongside.
        result = generate(stack.client(), make_request(prompt, 10, k=2, ignore_eos=True), timeout=30)
        assert result.token_ids == greedy_reference(target_model, prompt, 10)
    finally:
        stack.stop()


def test_call_timeout_is_what_the_requests_have_left(target_model, draft_model, tokenizer):
    stack = start_local_stack(target_model, draft_model, tokenizer)
    try:
        now = time.monotonic()
        a, b = (make_stub_request(now + 2.0), make_stub_request(now + 5.0))
        timeout, limited = call_timeout([a, b], 120.0)
        assert limited and 4.5 < timeout <= 5.0  # the call serves both: the longer one's time
        assert call_timeout([a, make_stub_request(None)], 120.0) == (120.0, False)
        assert call_timeout([make_stub_request(now + 500)], 120.0) == (120.0, False)
    finally:
        stack.stop()


def make_stub_request(deadline):
    class Stub:
        def time_left(self, now):
            return None if deadline is None else deadline - now

    return Stub()


def test_drain_finishes_in_flight_and_refuses_new(target_model, draft_model, tokenizer):
    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8)
    try:
        prompts = prompts_of_lengths([5, 9, 13, 7], seed=13)
        running = run_in_background(stack, prompts, 100)
        wait_for(lambda: info(stack).totals.steps > 3, what="steps")
        drained = threading.Thread(target=stack.coordinator.drain, args=(60.0,))
        drained.start()
        wait_for(lambda: stack.coordinator.scheduler.draining.is_set(), what="draining")
        with pytest.raises(grpc.RpcError) as raised:
            generate(stack.client(), make_request([1, 2, 3], 5), timeout=10)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert_exact(running.result(), prompts, target_model, 100)  # in flight: finished, exact
        drained.join(timeout=60)
        assert not drained.is_alive()
    finally:
        stack.stop()


def hold_after(engine, calls: int) -> threading.Event:
    """Let ``calls`` calls through this engine, then hold every later one until the returned
    event is set: the scheduler stays inside that step, so what is running stays running."""
    passed, release = [0], threading.Event()
    original = engine.start

    def gated_start(*args, **kwargs):
        passed[0] += 1
        if passed[0] > calls:
            release.wait(60)
        return original(*args, **kwargs)

    engine.start = gated_start
    return release


def test_queue_full_gives_resource_exhausted_with_retry_hint(target_model, draft_model, tokenizer):
    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=1, max_queue=1)
    release = hold_after(stack.target_engine, 1)
    try:
        # The first request's prefill passes; its first Verify is held. So it is running before
        # the second is sent (sent together, the second could find the first still queued and
        # be refused itself), and it cannot finish before the third is refused.
        prompt = prompts_of_lengths([6])[0]
        first = run_in_background(stack, [prompt], 150)
        wait_for(lambda: info(stack).running == 1, what="the first running")
        second = run_in_background(stack, [prompt], 150)
        wait_for(lambda: info(stack).waiting == 1, what="the second queued")
        assert info(stack).running == 1
        call = stack.client().Generate(make_request(prompt, 5))
        with pytest.raises(grpc.RpcError) as raised:
            list(call)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        hint = dict(raised.value.trailing_metadata())["retry-after-ms"]
        assert 250 <= int(hint) <= 30_000
        release.set()
        assert_exact(first.result() + second.result(), [prompt, prompt], target_model, 150)
    finally:
        release.set()
        stack.stop()


def test_dns_discovery_adds_and_removes_replicas(monkeypatch, target_model, draft_model, tokenizer):
    """Endpoints re-resolved while requests run: a replica that appears takes new sequences only
    (the running ones keep theirs); one that disappears has its sequences moved; output exact."""
    import coordinator.replicas as replicas_module

    extra = start_local_stack(target_model, None, tokenizer)  # a second target server to discover
    answer = {"dns:targets:0": []}
    real_resolve = replicas_module.resolve
    monkeypatch.setattr(replicas_module, "resolve", lambda spec: list(answer[spec]) if spec in answer
                        else real_resolve(spec))
    first = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8)
    first_address, second_address = f"127.0.0.1:{first.target.port}", f"127.0.0.1:{extra.target.port}"
    answer["dns:targets:0"] = [first_address]
    from coordinator.app import build_coordinator

    coordinator = build_coordinator("dns:targets:0", f"127.0.0.1:{first.draft.port}", tokenizer, eos_token_ids=frozenset(),
                                    refresh_seconds=0.1, max_batch_size=8)
    try:
        from specbatch.rpc.client import connect

        stub = connect(f"127.0.0.1:{coordinator.port}")
        prompts = prompts_of_lengths([5, 9, 13, 7], seed=17)
        requests = [make_request(p, 120, k=3, ignore_eos=True) for p in prompts]
        slow_down(first.target_engine, 0.01)
        running = futures.ThreadPoolExecutor(1).submit(generate_all, stub, requests, None, 120)
        wait_for(lambda: first.target_engine.sequences_created == 4, what="the first wave placed")
        answer["dns:targets:0"] = [first_address, second_address]  # scale-up
        wait_for(lambda: sum(r.healthy for r in stub.Info(gen_pb.InfoRequest()).replicas) == 3, what="joined")
        late = generate(stub, make_request(prompts[0], 20, k=3, ignore_eos=True), timeout=60)
        assert late.token_ids == greedy_reference(target_model, prompts[0], 20)
        assert extra.target_engine.sequences_created == 1  # the new request went to the idle replica
        assert first.target_engine.sequences_created == 4  # the running ones did not move
        answer["dns:targets:0"] = [second_address]  # the first replica leaves discovery mid-run
        assert_exact(running.result(), prompts, target_model, 120)
        assert extra.target_engine.sequences_created == 1 + 4  # all four moved there
    finally:
        coordinator.stop(grace=0)
        first.stop()
        extra.stop()


def test_two_coordinators_share_one_draft_and_target(target_model, draft_model, tokenizer):
    from coordinator.app import build_coordinator
    from specbatch.rpc.client import connect

    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8)
    other = build_coordinator(f"127.0.0.1:{stack.target.port}", f"127.0.0.1:{stack.draft.port}", tokenizer,
                              eos_token_ids=frozenset(), max_batch_size=8)
    try:
        prompts = prompts_of_lengths([5, 9, 13, 7, 11, 6], seed=19)
        requests = [make_request(p, 60, k=3, ignore_eos=True) for p in prompts]
        with futures.ThreadPoolExecutor(2) as pool:
            a = pool.submit(generate_all, stack.client(), requests[:3], None, 120)
            b = pool.submit(generate_all, connect(f"127.0.0.1:{other.port}"), requests[3:], None, 120)
            results = a.result() + b.result()
        assert_exact(results, prompts, target_model, 60)
        assert stack.draft_engine.sequences_created == len(prompts) and not stack.draft_engine.sequences
    finally:
        other.stop(grace=0)
        stack.stop()


def test_probe_gaps_and_reconnect_backoff_are_capped(monkeypatch):
    """The two waits that bound how long a replica that serves again stays marked down: the gap
    between probes (≤ 5 s at any attempt) and the channel's own reconnect backoff (≤ 1 s; gRPC's
    default grows to 120 s, during which every probe fails at once)."""
    from tenacity import RetryCallState

    import coordinator.backends as backends
    from coordinator.replicas import ReplicaSet

    replicas = ReplicaSet("target", "127.0.0.1:1", lambda address: None)
    gaps = []
    for attempt in range(1, 60):
        state = RetryCallState(None, None, (), {})
        state.attempt_number = attempt
        gaps.append(replicas.backoff(state))
    assert gaps[0] == pytest.approx(0.1) and max(gaps) == 5.0 and gaps == sorted(gaps)
    opened = {}
    monkeypatch.setattr(backends, "open_channel",
                        lambda address, credentials, options, server_name: opened.update(options) or grpc.insecure_channel(address))
    backends.TargetClient("127.0.0.1:1", 1.0).close()
    assert opened["grpc.max_reconnect_backoff_ms"] <= 1000 and opened["grpc.initial_reconnect_backoff_ms"] <= 1000
