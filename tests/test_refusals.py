"""Out of KV memory or sequence slots: a request waits for room while others run, or while another
coordinator's sequences hold it, and only a request that can never fit is refused, with
RESOURCE_EXHAUSTED; nothing else in flight is lost."""

import threading
import time
from concurrent import futures

import grpc
import pytest
from test_exactness import prompts_of_lengths
from tiny import greedy_reference

from coordinator.app import build_coordinator
from specbatch.protocol.errors import CapacityExceeded
from specbatch.rpc.client import generate, make_request
from specbatch.stack.in_process import start_local_stack
from specbatch.v1 import generation_pb2 as gen_pb
from specbatch.v1 import generation_pb2_grpc as gen_grpc
from specbatch.v1 import model_services_pb2 as mpb
from specbatch.v1 import model_services_pb2_grpc as mpb_grpc


def test_kv_budget_waits_or_refuses_without_harming_others(target_model, draft_model, tokenizer):
    # 100 kB of KV pool on the target, 768 bytes per token and slot: the small request (45 tokens)
    # fits beside anything that fits at all; the medium one (111 tokens, 85 kB) fits only alone;
    # the big one (201 tokens, 154 kB) never does.
    stack = start_local_stack(target_model, draft_model, tokenizer,
                              target_engine_options={"max_cache_bytes": 100_000})
    try:
        small_prompt, medium_prompt = [1, 9, 17, 33], [1] + [8] * 99
        results = {}

        def run(name, prompt, n):
            results[name] = generate(stack.client(), make_request(prompt, n, k=2, ignore_eos=True))

        small = threading.Thread(target=run, args=("small", small_prompt, 40))
        small.start()
        deadline = time.monotonic() + 30
        while not stack.target_engine.sequences and time.monotonic() < deadline:
            time.sleep(0.002)  # the others must arrive while the small one runs
        medium = threading.Thread(target=run, args=("medium", medium_prompt, 10))
        medium.start()
        with pytest.raises(grpc.RpcError) as refused:
            generate(stack.client(), make_request([1] + [7] * 199, 20, k=2, ignore_eos=True))
        small.join(timeout=60)
        medium.join(timeout=60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "KV cache" in refused.value.details()
        assert results["small"].token_ids == greedy_reference(target_model, small_prompt, 40)
        assert results["medium"].token_ids == greedy_reference(target_model, medium_prompt, 10)
        again = generate(stack.client(), make_request(small_prompt, 10, k=3, ignore_eos=True))
        assert again.token_ids == greedy_reference(target_model, small_prompt, 10)
    finally:
        stack.stop()


# ---- another coordinator's sequences (one that was killed: they stay until their lease ends) -------


def fill(address: str, stub_class, seq_ids: list[str]) -> None:
    """Create sequences on a model service directly, as another coordinator would."""
    with grpc.insecure_channel(address) as channel:
        stub_class(channel).Prefill(mpb.PrefillRequest(sequences=[
            mpb.SequenceInput(seq_id=s, keep_len=0, tokens=[1, 5, 6]) for s in seq_ids]), timeout=10)


def release(address: str, stub_class, seq_ids: list[str]) -> None:
    with grpc.insecure_channel(address) as channel:
        stub_class(channel).Release(mpb.ReleaseRequest(seq_ids=seq_ids), timeout=10)


def wait_for(condition, jobs=(), timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``condition`` until it holds; a job that ended meanwhile was refused: raise its error."""
    deadline = time.monotonic() + timeout
    while not condition():
        for job in jobs:
            if job.done():
                job.result()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_fresh_coordinator_waits_for_the_room_a_dead_ones_sequences_hold(target_model, draft_model, tokenizer):
    """Both services full of another coordinator's sequences: a fresh coordinator's requests
    wait in its queue (past the queue: RESOURCE_EXHAUSTED with a retry hint), and once those
    sequences are gone they complete, exact; the draft is used again once it has room."""
    stack = start_local_stack(target_model, draft_model, tokenizer, target_engine_options={"max_sequences": 4},
                              draft_engine_options={"max_sequences": 4})
    target, draft = f"127.0.0.1:{stack.target.port}", f"127.0.0.1:{stack.draft.port}"
    foreign = [f"dead-coordinator-{i}" for i in range(4)]
    fill(target, mpb_grpc.TargetStub, foreign)
    fill(draft, mpb_grpc.DraftStub, foreign)
    fresh = build_coordinator(target, draft, tokenizer, max_batch_size=8, max_queue=2, max_new_tokens=128)
    pool = futures.ThreadPoolExecutor(2)
    try:
        client = gen_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{fresh.port}"))
        info = lambda: client.Info(gen_pb.InfoRequest(), timeout=10)  # noqa: E731
        prompts = prompts_of_lengths([5, 9], seed=5)
        # One whose deadline passes while it waits leaves the queue then.
        with pytest.raises(grpc.RpcError) as late:
            list(client.Generate(make_request(prompts[0], 5), timeout=0.5))
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: info().waiting == 0, what="the expired request gone from the queue")
        jobs = [pool.submit(generate, client, make_request(p, 20, k=3, ignore_eos=True), None, 120) for p in prompts]
        wait_for(lambda: info().waiting == 2, jobs, what="both requests queued")
        with pytest.raises(grpc.RpcError) as refused:  # the queue is full: refused, with a hint
            list(client.Generate(make_request(prompts[0], 5), timeout=30))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert 250 <= int(dict(refused.value.trailing_metadata())["retry-after-ms"]) <= 30_000
        assert not any(job.done() for job in jobs) and len(stack.target_engine.sequences) == 4

        release(target, mpb_grpc.TargetStub, foreign)  # their lease ran out: the target has room
        for prompt, job in zip(prompts, jobs):
            assert job.result(timeout=120).token_ids == greedy_reference(target_model, prompt, 20)
        assert not stack.target_engine.sequences
        assert stack.draft_engine.sequences_created == 4  # the full draft was never asked to take more

        release(draft, mpb_grpc.DraftStub, foreign)
        (draft_replica,) = fresh.drafts.all()
        wait_for(lambda: draft_replica.crowded is None, what="the draft taking sequences again")
        result = generate(client, make_request(prompts[1], 20, k=3, ignore_eos=True, prompt_lookup=0), timeout=60)
        assert result.token_ids == greedy_reference(target_model, prompts[1], 20)
        assert result.stats.draft_tokens_proposed > 0 and stack.draft_engine.sequences_created == 5
    finally:
        pool.shutdown(wait=False)
        fresh.stop(grace=1)
        stack.stop()


def test_requests_refused_room_by_another_coordinators_sequences_wait_and_take_turns(target_model, draft_model,
                                                                                      tokenizer):
    """The target fills up with another coordinator's sequences after this one started: its
    requests, refused room there, wait; when one of those sequences goes, they take the one free
    slot in turn."""
    stack = start_local_stack(target_model, draft_model, tokenizer, target_engine_options={"max_sequences": 4})
    target = f"127.0.0.1:{stack.target.port}"
    others = ["other-0", "other-1", "other-2", "other-3"]
    fill(target, mpb_grpc.TargetStub, others)
    refused = []
    validate = stack.target_engine.validate

    def counting_refusals(*args, **kwargs):
        try:
            return validate(*args, **kwargs)
        except CapacityExceeded:
            refused.append(True)
            raise

    stack.target_engine.validate = counting_refusals
    pool = futures.ThreadPoolExecutor(3)
    try:
        prompts = prompts_of_lengths([5, 9, 7], seed=6)
        jobs = [pool.submit(generate, stack.client(), make_request(p, 20, k=3, ignore_eos=True), None, 120)
                for p in prompts]
        wait_for(lambda: refused and stack.coordinator.scheduler.load() == (0, 3), jobs,
                 what="the requests refused room, and waiting")
        release(target, mpb_grpc.TargetStub, others[:1])
        for prompt, job in zip(prompts, jobs):
            assert job.result(timeout=120).token_ids == greedy_reference(target_model, prompt, 20)
        assert set(stack.target_engine.sequences) == set(others[1:])
    finally:
        pool.shutdown(wait=False)
        stack.stop()
