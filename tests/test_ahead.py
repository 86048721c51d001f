"""Drafting ahead: while the target verifies, the draft guesses the verdict and drafts the next
step for each guess (draft_service/ahead.py, coordinator/step.py). Output stays exact; right guesses
skip the next step's Propose; the draft keeps no state of the guesses."""

from __future__ import annotations

import pytest
import torch
from test_eagle import distilled, eagle_draft  # noqa: F401 (fixtures)
from tiny import decode_while_the_draft_forgets, greedy_reference, random_prompts

from draft_service.ahead import AheadItem, propose_ahead
from draft_service.proposer import ProposeItem, propose
from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.protocol.errors import InvalidRequest
from specbatch.rpc.client import generate_all, make_request


@pytest.mark.parametrize("captured_steps", ["off", "static"])
def test_a_guess_drafts_what_a_propose_after_that_verdict_drafts(draft_model, captured_steps):
    """A plain draft (no target features): the drafts made ahead for the guess (j, t) are those a
    Propose makes once the history holds the chain's first j tokens and t; only the sequence's own
    tokens stay cached, and the forks are gone. Also through the captured steps' padded path
    (``static``: the forks sit in slots after the sequence's, their batch starts past slot 0)."""
    prompt, chain, k = [1, 7, 9, 11, 13], [20, 21, 22], 3
    engine = Engine(draft_model, max_sequences=16, max_context=64, captured_steps=captured_steps)
    guesses = propose_ahead(engine, [AheadItem(SequenceInput("s", 0, prompt), chain, guesses=3, k=k)])[0]
    assert list(engine.sequences) == ["s"] and engine.length("s") == len(prompt)
    assert {g.accepted for g in guesses} == {0, 1, 2, 3} and len(guesses) == 3 * (len(chain) + 1)
    for g in guesses:
        assert g.accepted == len(chain) or g.next_token != chain[g.accepted]
        history = prompt + chain[: g.accepted] + [g.next_token]
        fresh = Engine(draft_model)
        assert g.tokens == propose(fresh, [ProposeItem(SequenceInput("s", 0, history), k)])[0], g


def test_guesses_are_the_drafts_likeliest_tokens(draft_model):
    """At each position, the guesses are the draft's top tokens there (other than the chain's)."""
    prompt = [1, 5, 6, 7]
    engine = Engine(draft_model)
    chain = propose(Engine(draft_model), [ProposeItem(SequenceInput("s", 0, prompt), 2)])[0]
    guesses = propose_ahead(engine, [AheadItem(SequenceInput("s", 0, prompt), chain, guesses=2, k=1)])[0]
    with torch.no_grad():
        for j in range(len(chain) + 1):
            logits = draft_model(torch.tensor([prompt + chain[:j]])).logits[0, -1]
            top = [t for t in logits.topk(4).indices.tolist() if j == len(chain) or t != chain[j]][:2]
            assert [g.next_token for g in guesses if g.accepted == j] == top


def test_bad_ahead_items_are_refused_and_change_nothing(draft_model):
    engine = Engine(draft_model)
    for chain, guesses, k in (([], 2, 1), ([5], 0, 1), ([5], 9, 1), ([5], 2, 0)):
        with pytest.raises(InvalidRequest):
            propose_ahead(engine, [AheadItem(SequenceInput("s", 0, [1, 5]), chain, guesses, k)])
    assert not engine.sequences


@pytest.mark.parametrize("eagle", [False, True])
def test_greedy_output_drafting_ahead_matches_generate_and_skips_proposes(target_model, draft_model, eagle_draft,
                                                                          tokenizer, eagle):
    """Mixed batches through the services, drafting ahead: every output is target-only decoding,
    token for token; some verdicts were guessed right (their next step made no Propose), not all."""
    from specbatch.stack.in_process import start_local_stack

    stack = start_local_stack(target_model, eagle_draft if eagle else draft_model, tokenizer, max_batch_size=4,
                              max_new_tokens=64, draft_ahead=3)
    try:
        batch = random_prompts(seed=5, count=8)
        results = generate_all(stack.client(), [make_request(p, 30, k=2, ignore_eos=True) for p in batch],
                               concurrency=8)
        for prompt, result in zip(batch, results):
            assert result.token_ids == greedy_reference(target_model, prompt, 30)
        totals = stack.coordinator.scheduler.totals
        assert 0 < totals.ahead_hits < totals.ahead_guessed, vars(totals)
        assert not stack.draft_engines[0].sequences and not stack.target_engines[0].sequences
    finally:
        stack.stop()


def test_a_draft_that_forgets_its_sequences_while_drafting_ahead_costs_no_token(target_model, eagle_draft,
                                                                                  tokenizer):
    """The draft loses every sequence now and then mid-request: a ProposeAhead then finds its
    sequence gone (FAILED_PRECONDITION), the coordinator rebuilds the draft from the history, and
    the output is still target-only decoding."""
    from specbatch.stack.in_process import start_local_stack

    stack = start_local_stack(target_model, eagle_draft, tokenizer, max_batch_size=4, max_new_tokens=64,
                              draft_ahead=2)
    try:
        responses = decode_while_the_draft_forgets(stack, target_model, random_prompts(seed=11, count=1)[0])
        assert responses > 6 and stack.coordinator.scheduler.totals.ahead_guessed > 0
    finally:
        stack.stop()
