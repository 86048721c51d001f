"""Prompts prefilled in chunks between decode steps (the coordinator's ``--prefill-chunk``), through
the real services on tiny models: output stays target-only decoding token for token, with a plain
draft and with an EAGLE-style one (which reads the target's features of every prompt token, stored
chunk by chunk); seeded sampled requests draw the same tokens as with whole prefills. The rounds
themselves, and a prompt restarted mid-way: tests/test_scheduler.py."""

from __future__ import annotations

import random

import pytest
from test_eagle import distilled, eagle_draft  # noqa: F401 (fixtures)
from tiny import VOCAB, greedy_reference

from specbatch.config.speculation import SpeculationConfig
from specbatch.rpc.client import generate_all, make_request

CHUNK = 5


def prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts of 2 to 4 chunks' length and one shorter than a chunk."""
    rng = random.Random(seed)
    return [[rng.randrange(5, VOCAB) for _ in range(rng.randrange(2 * CHUNK, 4 * CHUNK) if i else CHUNK - 2)]
            for i in range(count)]


@pytest.mark.parametrize("eagle", [False, True])
def test_greedy_output_with_chunked_prefill_matches_generate(target_model, draft_model, eagle_draft, tokenizer,
                                                             eagle):
    """Six requests on four batch slots (the last two are admitted as earlier ones finish, while
    others decode), drafting k = 2 with leaves, one of them target-only: each output is
    target-only decoding."""
    from specbatch.stack.in_process import start_local_stack

    stack = start_local_stack(target_model, eagle_draft if eagle else draft_model, tokenizer, max_batch_size=4,
                              max_new_tokens=64, prefill_chunk=CHUNK, speculation=SpeculationConfig(leaves=2))
    try:
        batch = prompts(6, seed=11)
        requests = [make_request(p, 12 + 3 * i, ignore_eos=True, k=0 if i == 4 else 2) for i, p in enumerate(batch)]
        results = generate_all(stack.client(), requests, concurrency=6)
        for i, (prompt, result) in enumerate(zip(batch, results)):
            assert result.token_ids == greedy_reference(target_model, prompt, 12 + 3 * i), i
        assert not stack.draft_engines[0].sequences and not stack.target_engines[0].sequences
    finally:
        stack.stop()


def test_sampled_requests_draw_the_same_tokens_whether_prefilled_whole_or_in_chunks(target_model, draft_model,
                                                                                     tokenizer):
    """A chunk before a prompt's last decides a token nobody keeps; draws go by position, so
    seeded sampled requests draw what they draw with whole prefills."""
    from specbatch.stack.in_process import start_local_stack

    batch = prompts(4, seed=12)
    # k and leaves pinned: seeded tokens depend on both, and the policy chooses them by the load
    requests = [make_request(p, 20, k=2, leaves=0, ignore_eos=True, temperature=0.8, seed=30 + i)
                for i, p in enumerate(batch)]
    outputs = []
    for chunk in (0, CHUNK):
        stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=4, max_new_tokens=64,
                                  prefill_chunk=chunk)
        try:
            outputs.append([result.token_ids for result in generate_all(stack.client(), requests, concurrency=4)])
        finally:
            stack.stop()
    assert all(len(tokens) == 20 for tokens in outputs[0])
    assert outputs[0] == outputs[1]


def test_an_eagle_draft_drafts_the_same_after_a_chunked_prefill(target_model, eagle_draft, tokenizer):
    """The target's features of a prompt arrive chunk by chunk and are stored where each chunk
    starts: the draft, which reads them, proposes and gets accepted exactly what it does after a
    whole prefill (the engine's rows do not depend on how a prompt was split)."""
    from specbatch.stack.in_process import start_local_stack

    batch = prompts(4, seed=13)
    # k and leaves pinned: the counts compared depend on both, and the policy prices leaves by time
    requests = [make_request(p, 24, ignore_eos=True, k=3, leaves=0) for p in batch]
    runs = []
    for chunk in (0, CHUNK):
        stack = start_local_stack(target_model, eagle_draft, tokenizer, max_batch_size=4, max_new_tokens=64,
                                  prefill_chunk=chunk)
        try:
            results = generate_all(stack.client(), requests, concurrency=1)
            runs.append([(r.token_ids, r.stats.draft_tokens_proposed, r.stats.draft_tokens_accepted) for r in results])
        finally:
            stack.stop()
    assert sum(accepted for _, _, accepted in runs[0]) > 0
    assert runs[0] == runs[1]


def test_the_flag_reaches_the_coordinator_and_a_negative_one_is_refused(capsys):
    import argparse

    from coordinator.app import main as coordinator_main
    from specbatch.config.options import UP, add_options
    from specbatch.stack.defaults import stack_options
    from specbatch.stack.processes import LocalProcesses

    parser = add_options(argparse.ArgumentParser(), UP)
    processes = LocalProcesses(stack_options(parser.parse_args(["--prefill-chunk", "256"])))
    spawned = []
    processes._spawn, processes.draft_address = (lambda name, module, flags: spawned.append(flags)), None
    processes._spawn_coordinator("coordinator", "fixed:0", 1, None)
    assert spawned[0][spawned[0].index("--prefill-chunk") + 1] == "256"
    with pytest.raises(SystemExit):
        coordinator_main(["--target", "127.0.0.1:1", "--prefill-chunk", "-1"])
    assert "--prefill-chunk must be 0 (off) or a number of tokens" in capsys.readouterr().err
