"""A draft hosted in the target's process (``python -m target_service --with-draft``): each Verify
also drafts the next step (target_service/drafting.py), and the output stays the target's."""

from __future__ import annotations

import grpc
import pytest
from test_eagle import distilled, eagle_draft  # noqa: F401 (fixtures)
from tiny import ForgetEveryThird, greedy_mixed_batch, greedy_reference, random_prompts

from coordinator.backends import Call
from coordinator.in_process import InProcessTarget
from draft_service.servicer import DraftServicer
from specbatch.engine.engine import Engine
from specbatch.protocol.sampling_params import SamplingParams
from specbatch.rpc.client import generate, generate_all, make_request
from specbatch.stack.in_process import start_local_stack
from target_service.servicer import TargetServicer


@pytest.fixture
def hosted_stack(target_model, eagle_draft, tokenizer):
    stack = start_local_stack(target_model, eagle_draft, tokenizer, max_batch_size=8, max_new_tokens=128,
                              draft_in_target=True)
    yield stack
    stack.stop()


@pytest.fixture
def counted(monkeypatch):
    """The sequences of each Propose the draft servicers answered (the hosted draft's too), for
    servicers made after it (a server binds their methods when it starts)."""
    calls = []
    propose = DraftServicer.Propose

    def counting(self, request, context):
        calls.append(len(request.items))
        return propose(self, request, context)

    monkeypatch.setattr(DraftServicer, "Propose", counting)
    return calls


def test_greedy_output_is_the_targets_with_one_call_a_step(counted, hosted_stack, target_model):
    """A mixed batch at k = 3 with a leaf: token for token the same stack's k = 0 output and the
    model's own greedy decoding; drafts are accepted, and most come from inside the Verify: the
    draft service's own Propose drafts for a sequence only to start it, or after steps that prompt
    lookup drafted (its chains keep more than the draft's on these prompts)."""
    speculative = greedy_mixed_batch(hosted_stack, seed=21, k=3)
    proposed = sum(counted)
    prompts = random_prompts(21, 6)
    assert [r.token_ids for r in speculative] == [greedy_reference(target_model, p, 30) for p in prompts]
    assert [r.token_ids for r in greedy_mixed_batch(hosted_stack, seed=21, k=0)] == [r.token_ids for r in speculative]
    accepted = sum(r.stats.draft_tokens_accepted for r in speculative)
    steps = sum(r.stats.steps for r in speculative)
    assert accepted > 0
    assert 0 < proposed and 3 * proposed < steps


def test_sampled_output_is_the_same_whichever_process_drafts(target_model, eagle_draft, tokenizer):
    """Seeded sampled requests draw every token from (seed, position): a draft hosted in the
    target's process proposes what a draft service of its own would, so both placements stream the
    same tokens."""
    requests = [make_request(p, 24, temperature=0.9, top_p=0.95, seed=100 + i, k=3, ignore_eos=True)
                for i, p in enumerate(random_prompts(22, 4))]
    outputs = {}
    for hosted in (False, True):
        stack = start_local_stack(target_model, eagle_draft, tokenizer, max_batch_size=8, max_new_tokens=64,
                                  draft_in_target=hosted)
        try:
            outputs[hosted] = [r.token_ids for r in generate_all(stack.client(), requests)]
        finally:
            stack.stop()
    assert outputs[True] == outputs[False]
    assert all(len(tokens) == 24 for tokens in outputs[True])


def test_a_hosted_draft_that_loses_its_sequences_is_rebuilt(hosted_stack, target_model):
    """The draft forgets every sequence every third response (the target keeps its own): its next
    Verify names a draft cache that is gone, the coordinator rebuilds both from its history, and
    the output is still the target's."""
    prompt = random_prompts(23, 1)[0]
    forget = ForgetEveryThird(hosted_stack.draft_engines[0])
    result = generate(hosted_stack.client(), make_request(prompt, 40, k=2, ignore_eos=True), on_response=forget)
    assert result.token_ids == greedy_reference(target_model, prompt, 40)
    assert len(forget.responses) > 6


def test_the_hosted_drafting_is_the_drafts_part_of_a_step(hosted_stack):
    """The draft's compute inside each Verify counts as the step's draft part, not the target's:
    what a policy prices a verify row (a leaf) at is the target's own time."""
    for prompt in random_prompts(25, 2):
        generate(hosted_stack.client(), make_request(prompt, 30, k=2, ignore_eos=True, prompt_lookup=0))
    totals = hosted_stack.coordinator.scheduler.totals
    assert totals.draft_compute_seconds > 0
    assert totals.draft_seconds >= totals.draft_compute_seconds
    assert totals.target_seconds >= totals.target_compute_seconds > 0
    assert totals.step_seconds >= totals.draft_seconds + totals.target_seconds


def test_a_plain_draft_hosted_in_the_target(target_model, draft_model, tokenizer):
    """A draft that reads no target features (the target's first layers) drafts inside the Verify too."""
    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8, max_new_tokens=64,
                              draft_in_target=True)
    try:
        results = greedy_mixed_batch(stack, seed=24, k=2)
        assert [r.token_ids for r in results] == [greedy_reference(target_model, p, 30) for p in random_prompts(24, 6)]
        assert sum(r.stats.draft_tokens_accepted for r in results) > 0
    finally:
        stack.stop()


def _propose_next(client, seq_id: str, keep_len: int, tokens: list[int], draft_call: Call, k: int = 2, create=False):
    return client.verify([Call(seq_id, keep_len, tokens)], [[]], [SamplingParams()], create=create,
                         propose_next=[(k, [], draft_call)])


def test_propose_next_is_refused_clearly_and_changes_nothing(target_model, draft_model):
    """Without a hosted draft, with k out of range, with more feature rows than tokens or a draft
    cache the draft does not hold: INVALID_ARGUMENT (or the lost-state code for the cache), and
    neither engine holds anything it did not hold before."""
    target = Engine(target_model, max_sequences=4)
    plain = InProcessTarget(TargetServicer(target, "target"))
    with pytest.raises(grpc.RpcError) as refused:
        _propose_next(plain, "a", 0, [1, 5, 6], Call("a", 0, [1, 5, 6]), create=True)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hosts no draft" in refused.value.details()
    assert not target.sequences

    draft = Engine(draft_model, max_sequences=4, model_thread=target.model_thread, lock=target.lock)
    hosted = InProcessTarget(TargetServicer(target, "target", draft=draft, draft_name="draft"))
    assert hosted.cache_stats().hosted_draft == "draft"
    for k in (0, 99):
        with pytest.raises(grpc.RpcError) as refused:
            _propose_next(hosted, "a", 0, [1, 5, 6], Call("a", 0, [1, 5, 6]), k=k, create=True)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as refused:
        _propose_next(hosted, "a", 0, [1, 5, 6], Call("a", 3, [1, 5, 6]), create=True)
    assert refused.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
    assert not target.sequences and not draft.sequences

    reply = _propose_next(hosted, "a", 0, [1, 5, 6], Call("a", 0, [1, 5, 6]), create=True)
    verdict = reply.verdicts[0]
    assert verdict.cached_len == 3 and len(verdict.proposal.tokens) == 2
    # The plain draft read the prompt and the next token, and keeps its own first proposal's keys.
    assert verdict.proposal.cached_len == draft.length("a") and draft.length("a") >= 4
    assert reply.draft_compute_seconds > 0 and reply.compute_seconds > 0  # the draft's part reported apart


def test_each_target_replica_drafts_with_the_draft_it_hosts(target_model, eagle_draft, tokenizer, counted):
    """Two target replicas, each hosting a draft: a request's draft is placed in its target's process
    (the same address), so every replica drafts inside its own Verify calls; output stays exact."""
    stack = start_local_stack(target_model, eagle_draft, tokenizer, max_batch_size=8, max_new_tokens=64,
                              target_replicas=2, draft_in_target=True)
    try:
        results = greedy_mixed_batch(stack, seed=25, k=2)
        assert [r.token_ids for r in results] == [greedy_reference(target_model, p, 30) for p in random_prompts(25, 6)]
        for target_engine, draft_engine in zip(stack.target_engines, stack.draft_engines):
            assert target_engine.sequences_created > 0 and draft_engine.sequences_created > 0
            assert draft_engine.model_thread is target_engine.model_thread
        assert 3 * sum(counted) < sum(r.stats.steps for r in results)  # most drafted inside the Verify calls
    finally:
        stack.stop()
