"""Greedy output through the three services is token-identical to target-only `generate`."""

from __future__ import annotations

import random
import threading
import time
from concurrent import futures

import pytest
from tiny import VOCAB, greedy_reference

from specbatch.rpc.client import generate, generate_all, make_request


def prompts_of_lengths(lengths, seed=0):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(5, VOCAB) for _ in range(n - 1)] for n in lengths]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_batch_of_one_matches_generate(stack, target_model, k):
    prompt = prompts_of_lengths([7])[0]
    result = generate(stack.client(), make_request(prompt, 40, k=k, ignore_eos=True))
    assert result.token_ids == greedy_reference(target_model, prompt, 40)
    assert result.finish == "length"
    assert result.stats.generated_tokens == 40
    assert result.stats.draft_tokens_proposed > 0
    # Each step yields accepted drafts + 1 token.
    assert result.stats.steps + result.stats.draft_tokens_accepted == 40 - 1


@pytest.mark.parametrize("k", [1, 3, 5])
def test_sixteen_staggered_requests_match_generate(stack, target_model, k):
    """16 requests of different prompt lengths join a running batch (max 8) at different times."""
    lengths = [1 + (i * 7) % 41 for i in range(16)]
    prompts = prompts_of_lengths(lengths, seed=k)
    new_tokens = [12 + (i * 5) % 29 for i in range(16)]
    run_staggered_and_check(stack.client(), target_model, prompts, new_tokens, k)


def run_staggered_and_check(client, target_model, prompts, new_tokens, k=None) -> None:
    """Start the requests a little apart (so they join a running batch at different steps) and
    check every output against target-only greedy decoding."""
    results: dict[int, object] = {}

    def run(i):
        time.sleep(0.01 * (i % 5))
        results[i] = generate(client, make_request(prompts[i], new_tokens[i], k=k, ignore_eos=True))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join(timeout=120)
    assert len(results) == len(prompts)
    for i in range(len(prompts)):
        assert results[i].token_ids == greedy_reference(target_model, prompts[i], new_tokens[i]), f"request {i}"


def test_mixed_k_and_sampled_neighbours_leave_greedy_exact(stack, target_model):
    """Per-request k, k=0 and sampled requests in one batch do not change any greedy output."""
    prompts = prompts_of_lengths([3, 9, 15, 21, 5], seed=7)
    requests = [make_request(p, 30, k=k, ignore_eos=True) for p, k in zip(prompts, [0, 1, 2, 4, 6])]
    requests.append(make_request(prompts[0], 30, temperature=1.0, seed=5, ignore_eos=True))
    results = generate_all(stack.client(), requests, timeout=120)
    for i, prompt in enumerate(prompts):
        assert results[i].token_ids == greedy_reference(target_model, prompt, 30)
    assert results[0].stats.draft_tokens_proposed == 0  # k=0 means target-only
    assert len(results[-1].token_ids) == 30


def test_eos_stops_and_is_reported(target_model, draft_model, tokenizer):
    from specbatch.stack.in_process import start_local_stack

    prompt = prompts_of_lengths([6], seed=3)[0]
    reference = greedy_reference(target_model, prompt, 40)
    eos = reference[10]  # pretend this token is EOS: generation must stop right after it
    stack = start_local_stack(target_model, draft_model, tokenizer, eos_token_ids=frozenset({eos}))
    try:
        result = generate(stack.client(), make_request(prompt, 40, k=4))
        assert result.finish == "eos"
        assert result.token_ids == reference[: reference.index(eos) + 1]
        ignored = generate(stack.client(), make_request(prompt, 40, k=4, ignore_eos=True))
        assert ignored.token_ids == reference
    finally:
        stack.stop()


def test_stop_string_cuts_text(stack, target_model, tokenizer):
    prompt = prompts_of_lengths([5], seed=11)[0]
    reference = greedy_reference(target_model, prompt, 30)
    full = tokenizer.decode(reference, skip_special_tokens=True)
    word = tokenizer.decode(reference[8:9])
    result = generate(stack.client(), make_request(prompt, 30, k=3, stop=[word], ignore_eos=True))
    assert result.finish == "stop"
    assert result.text == full[: full.index(word)]
    assert word not in result.text
    # token ids stop at the token that completed the stop string
    assert result.token_ids == reference[: reference.index(reference[8]) + 1]


def test_max_new_tokens_one(stack, target_model):
    prompt = prompts_of_lengths([4])[0]
    result = generate(stack.client(), make_request(prompt, 1, k=5, ignore_eos=True))
    assert result.token_ids == greedy_reference(target_model, prompt, 1)
    assert result.finish == "length"


def test_seeded_sampling_is_reproducible_across_batch_mixes(stack):
    prompt = prompts_of_lengths([8], seed=2)[0]
    # k and leaves pinned: seeded tokens depend on both, and the policy chooses them by the load
    request = make_request(prompt, 25, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True, k=3, leaves=0)
    alone = generate(stack.client(), request)
    client = stack.client()
    others = [threading.Thread(target=generate, args=(client, make_request(p, 25, k=3, ignore_eos=True)))
              for p in prompts_of_lengths([3, 12, 30], seed=4)]
    for t in others:
        t.start()
    mixed = generate(client, request)
    for t in others:
        t.join(timeout=60)
    assert mixed.token_ids == alone.token_ids
    different = generate(client, make_request(prompt, 25, temperature=0.9, top_p=0.9, seed=99, ignore_eos=True, k=3, leaves=0))
    assert different.token_ids != alone.token_ids


def forget_everything_mid_run(engine, settle: float) -> None:
    """Once the engine holds sequences, wait ``settle`` seconds, then drop them all between two
    calls, as a restart would."""
    deadline = time.monotonic() + 30
    while not engine.sequences and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(settle)
    with engine.lock:
        engine.sequences.clear()


@pytest.mark.parametrize("which", ["target", "draft"])
def test_lost_service_state_is_rebuilt_from_history(stack, target_model, which):
    """A service that forgets every sequence (as after a restart) costs time, not requests."""
    prompts = prompts_of_lengths([5, 17, 9], seed=21)
    requests = [make_request(p, 60, k=3, ignore_eos=True) for p in prompts]
    running = futures.ThreadPoolExecutor(1).submit(generate_all, stack.client(), requests, None, 120)
    forget_everything_mid_run(stack.target_engine if which == "target" else stack.draft_engine, settle=0.05)
    results = running.result()
    for i, prompt in enumerate(prompts):
        assert results[i].token_ids == greedy_reference(target_model, prompt, 60)


def test_cancelled_stream_releases_caches(stack):
    prompt = prompts_of_lengths([6])[0]
    call = stack.client().Generate(make_request(prompt, 120, k=2, ignore_eos=True))
    next(call)
    assert stack.target_engine.sequences  # the sequence is cached while it runs
    call.cancel()
    deadline = time.monotonic() + 10
    while (stack.target_engine.sequences or stack.draft_engine.sequences) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not stack.target_engine.sequences
    assert not stack.draft_engine.sequences


def test_clients_reusing_a_request_id_do_not_share_caches(stack, target_model):
    prompts = prompts_of_lengths([4, 19], seed=41)
    requests = [make_request(p, 30, k=3, ignore_eos=True) for p in prompts]
    for request in requests:
        request.request_id = "same-id"
    results = generate_all(stack.client(), requests, timeout=60)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_reference(target_model, prompt, 30)
