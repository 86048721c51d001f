"""Sampled requests through the services: they speculate, seeded ones give the same tokens in any
batch mix, greedy neighbours stay exact, and bad sampling input gets INVALID_ARGUMENT.

(Exactness in distribution is tests/test_speculative_sampling.py; these are the serving properties.)
"""

from __future__ import annotations

import math
from concurrent import futures

import grpc
import pytest
from test_exactness import forget_everything_mid_run, prompts_of_lengths
from tiny import VOCAB, greedy_reference

from specbatch.rpc.client import generate, generate_all, make_request
from specbatch.v1 import model_services_pb2 as mpb
from specbatch.v1 import model_services_pb2_grpc as mpb_grpc

SAMPLED = dict(temperature=1.0, top_p=0.95, top_k=40)


@pytest.mark.parametrize("k, leaves", [(1, None), (2, None), (4, None), (8, None), (2, 3)])
def test_seeded_request_gives_the_same_tokens_alone_and_in_any_mix(stack, target_model, k, leaves):
    """The same seeded request alone, then among greedy and sampled neighbours of other k
    (each mix a different batch composition and row order): the same tokens every time. With
    leaves, ours and a greedy neighbour verify the draft's next-best tokens beside the chain."""
    prompt = prompts_of_lengths([9], seed=k)[0]
    ours = make_request(prompt, 30, seed=1234, k=k, ignore_eos=True, leaves=leaves or 0, **SAMPLED)
    client = stack.client()
    alone = generate(client, ours, timeout=60)
    assert alone.stats.draft_tokens_proposed > 0  # sampled requests speculate
    others = prompts_of_lengths([3, 14, 6, 21, 11], seed=100 + k)
    neighbours = [make_request(others[0], 25, k=3, ignore_eos=True, leaves=leaves),
                  make_request(others[1], 40, k=0, ignore_eos=True),
                  make_request(others[2], 20, seed=5, k=5, ignore_eos=True, **SAMPLED),
                  make_request(others[3], 35, seed=6, temperature=0.6, ignore_eos=True),  # the policy's k
                  make_request(others[4], 30, seed=7, k=1, temperature=1.4, top_k=5, ignore_eos=True)]
    for mix in (neighbours[:3] + [ours] + neighbours[3:], [ours] + neighbours[::-1]):
        results = generate_all(client, mix, timeout=120)
        assert results[mix.index(ours)].token_ids == alone.token_ids
        for request, result in zip(mix, results):
            if request.sampling.temperature == 0:
                prompt_ids = list(request.token_ids.ids)
                assert result.token_ids == greedy_reference(target_model, prompt_ids, request.max_new_tokens)
    totals = stack.coordinator.scheduler.totals
    if leaves:  # (unasked, the policy verifies leaves only where it prices them to pay)
        assert totals.leaf_hits > 0, (totals.leaf_chances, totals.leaf_hits)


def test_sampled_requests_accept_drafts(stack):
    """Sampled drafts get accepted far more often than chance (1/96) with the fixture's draft
    (the target's first 2 of 3 layers; about a quarter at temperature 0.8)."""
    prompts = prompts_of_lengths([5, 12, 8, 17], seed=3)
    results = generate_all(stack.client(), [make_request(p, 40, seed=i, k=4, ignore_eos=True, temperature=0.8)
                                            for i, p in enumerate(prompts)], timeout=120)
    proposed = sum(r.stats.draft_tokens_proposed for r in results)
    accepted = sum(r.stats.draft_tokens_accepted for r in results)
    assert proposed > 0 and accepted / proposed > 0.1, (accepted, proposed)
    assert all(len(r.token_ids) == 40 for r in results)


@pytest.mark.parametrize("which", ["target", "draft"])
def test_seeded_tokens_survive_a_service_losing_its_state(stack, which):
    """A service that forgets every sequence mid-run (as after a restart) is rebuilt from the
    coordinator's history; a seeded request still gets exactly the tokens of an undisturbed run
    (every draw is keyed by seed and position, and the rebuilt step drafts the same tokens)."""
    prompt = prompts_of_lengths([7], seed=21)[0]
    request = make_request(prompt, 60, seed=99, k=3, leaves=0, ignore_eos=True, **SAMPLED)
    undisturbed = generate(stack.client(), request, timeout=60)
    running = futures.ThreadPoolExecutor(1).submit(generate, stack.client(), request, None, 120)
    forget_everything_mid_run(stack.target_engine if which == "target" else stack.draft_engine, settle=0.03)
    assert running.result().token_ids == undisturbed.token_ids


# ---- bad sampling input --------------------------------------------------------------------------

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def expect_invalid(call, words: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == INVALID, caught.value.details()
    assert words in caught.value.details(), caught.value.details()


# tests/test_bad_input.py covers temperature -0.5, NaN and inf, top_p 1.5 and -0.2, top_k -1.
@pytest.mark.parametrize("field, value, words", [
    ("temperature", -math.inf, "temperature"),
    ("temperature", -1e-30, "temperature"),
    ("top_p", math.nan, "top_p"),
    ("top_p", math.inf, "top_p"),
    ("top_p", 1.0000001, "top_p"),
    ("top_k", -(2**31), "top_k"),
])
def test_bad_sampling_parameters_are_refused_by_the_coordinator(stack, field, value, words):
    request = make_request([1, 17, 42], 8, temperature=0.8)
    setattr(request.sampling, field, value)
    expect_invalid(lambda: generate(stack.client(), request, timeout=30), words)


@pytest.fixture
def services(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.target.port}") as target, \
            grpc.insecure_channel(f"127.0.0.1:{stack.draft.port}") as draft:
        yield mpb_grpc.TargetStub(target), mpb_grpc.DraftStub(draft)


BAD_SAMPLING = [
    (mpb.Sampling(temperature=-1.0), "temperature"),
    (mpb.Sampling(temperature=math.nan), "temperature"),
    (mpb.Sampling(temperature=0.8, top_p=1.5), "top_p"),
    (mpb.Sampling(temperature=0.8, top_p=-0.1), "top_p"),
    (mpb.Sampling(temperature=0.8, top_p=math.nan), "top_p"),
    (mpb.Sampling(temperature=0.8, top_k=-3), "top_k"),
]


def test_model_services_refuse_bad_sampling_and_malformed_q(stack, services):
    """Both services check what they are sent themselves (they serve other callers too); a
    refused call changes no state."""
    target, draft = services
    prompt = [1, 30, 31, 32, 33]
    seq = lambda keep, tokens: mpb.SequenceInput(seq_id="x", keep_len=keep, tokens=tokens)  # noqa: E731
    target.Prefill(mpb.PrefillRequest(sequences=[seq(0, prompt[:-1])]), timeout=10)
    draft.Prefill(mpb.PrefillRequest(sequences=[seq(0, prompt[:-1])]), timeout=10)
    sampling = mpb.Sampling(temperature=1.0, seed=3)
    proposal, = draft.Propose(mpb.ProposeRequest(items=[mpb.ProposeItem(sequence=seq(4, prompt[-1:]), k=3,
                                                                       sampling=sampling)]), timeout=10).proposals
    assert len(proposal.tokens) == 3 and len(proposal.distributions) == 3
    for token, q in zip(proposal.tokens, proposal.distributions):
        assert token in q.token_ids and len(set(q.token_ids)) == len(q.token_ids) and 0 < sum(q.probs) <= 1.0001

    def verify(sampling=sampling, drafts=proposal.tokens, distributions=proposal.distributions):
        item = mpb.VerifyItem(sequence=seq(4, prompt[-1:]), draft_tokens=drafts, sampling=sampling,
                              draft_distributions=distributions)
        return target.Verify(mpb.VerifyRequest(items=[item]), timeout=10)

    for bad, words in BAD_SAMPLING:
        expect_invalid(lambda: verify(sampling=bad), words)
        expect_invalid(lambda: draft.Propose(mpb.ProposeRequest(items=[mpb.ProposeItem(
            sequence=seq(4, prompt[-1:]), k=2, sampling=bad)]), timeout=10), words)

    q = list(proposal.distributions)
    first = q[0]
    others = [t for t in range(VOCAB) if t not in first.token_ids]

    def with_first(token_ids, probs):
        return [mpb.DraftDistribution(token_ids=token_ids, probs=probs)] + q[1:]

    malformed = [
        (q[:2], "distribution of each draft token"),
        ([], "distribution of each draft token"),
        (with_first(list(first.token_ids), list(first.probs)[:-1]), "probabilities"),
        (with_first([], []), "0 token ids"),
        (with_first(list(range(VOCAB)) * 11, [0.001] * (11 * VOCAB)), "1 to 1024"),
        (with_first(list(first.token_ids[:-1]) + [VOCAB], list(first.probs)), "outside"),
        (with_first(list(first.token_ids[:-1]) + [-1], list(first.probs)), "outside"),
        (with_first(list(first.token_ids[:-1]) + [first.token_ids[0]], list(first.probs)), "twice"),
        (with_first(list(first.token_ids), [-0.5] + list(first.probs[1:])), "negative or not finite"),
        (with_first(list(first.token_ids), [math.nan] + list(first.probs[1:])), "negative or not finite"),
        (with_first(list(first.token_ids), [math.inf] + list(first.probs[1:])), "negative or not finite"),
        (with_first(list(first.token_ids), [0.0] * len(first.probs)), "no probability mass"),
        (with_first(others[:3], [0.5, 0.3, 0.2]), "gives its draft token no probability"),
    ]
    for distributions, words in malformed:
        expect_invalid(lambda: verify(distributions=distributions), words)
    assert stack.target_engine.length("x") == 4 and stack.draft_engine.length("x") == 4 + 1 + 2

    # The well-formed call, twice (as a retry after a lost reply would): the same verdict.
    first_reply, again = verify(), verify()
    assert first_reply.verdicts == again.verdicts
    assert first_reply.verdicts[0].cached_len == 4 + 1 + first_reply.verdicts[0].accepted
