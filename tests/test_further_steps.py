"""A Verify's further steps (``VerifyRequest.further_steps``, the coordinator's --steps-per-call):
several decode steps in one call on a target that hosts the draft, every step's verdicts coming
back, the tokens those of a call a step (target_service/further.py, coordinator/step.py)."""

from __future__ import annotations

import time

import grpc
import pytest
from test_eagle import distilled, eagle_draft  # noqa: F401 (fixtures)
from tiny import greedy_reference, random_prompts

from coordinator.backends import Call
from coordinator.by_hand import greedy_request, stepped_by_hand
from coordinator.in_process import InProcessDraft, InProcessTarget
from coordinator.policy import AllLeaves, FixedK
from draft_service.servicer import DraftServicer
from specbatch.config.speculation import SpeculationConfig
from specbatch.engine.engine import Engine
from specbatch.protocol.speculation import MAX_FURTHER_STEPS
from specbatch.rpc.client import generate_all, make_request
from specbatch.stack.in_process import start_local_stack
from target_service.servicer import TargetServicer


def hosted_pair(target_model, draft_model):
    """A target servicer hosting the draft on its model thread, and the coordinator's clients of
    both (one address: the coordinator drafts inside each Verify)."""
    target = Engine(target_model, max_sequences=8)
    draft = Engine(draft_model, max_sequences=8, model_thread=target.model_thread, lock=target.lock)
    servicer = TargetServicer(target, "target", draft=draft, draft_name="draft")
    return (target, draft, InProcessTarget(servicer, address="hosted"),
            InProcessDraft(DraftServicer(draft, "draft"), address="hosted"))


def decode_by_hand(pair, prompts: list[list[int]], k: int, further: int, max_new_tokens: int = 24,
                   stop_token_ids=frozenset()) -> tuple[list[list[int]], int]:
    """Greedy requests stepped together by hand at a fixed k, each call with up to ``further``
    more steps: their tokens, and the calls made."""
    target, draft, target_client, draft_client = pair
    requests = [greedy_request(f"r{i}", p, max_new_tokens, stop_token_ids=stop_token_ids)
                for i, p in enumerate(prompts)]
    speculation = SpeculationConfig(k_policy=f"fixed:{k}", leaves=0, prompt_lookup=0, shared_lookup=0)
    calls = 0
    with stepped_by_hand(target_client, draft_client, requests, FixedK(k), speculation, 512,
                         draft.feature_size) as scheduler:
        while any(r.finish is None for r in requests):
            assert scheduler.step(further) is not None
            calls += 1
    return [r.history[len(p):] for r, p in zip(requests, prompts)], calls


@pytest.mark.parametrize("k", [0, 2])
def test_a_call_of_several_steps_takes_the_tokens_of_a_call_a_step(target_model, eagle_draft, k):
    """Three requests at a fixed k: the same tokens as the model's own greedy decoding whatever the
    steps a call, in a third of the calls or fewer with four steps a call (the first call of each
    k is one step: a request goes further only once it keeps its k)."""
    pair = hosted_pair(target_model, eagle_draft)
    prompts = random_prompts(41, 3)
    reference = [greedy_reference(target_model, p, 24) for p in prompts]
    one, calls_one = decode_by_hand(pair, prompts, k, 0)
    four, calls_four = decode_by_hand(pair, prompts, k, 3)
    assert one == reference and four == reference
    assert 3 * calls_four <= calls_one + 3


def test_a_request_ends_on_its_stop_token_and_its_length_inside_a_call(target_model, eagle_draft):
    """A stop token met in a further step ends its request there, and a length that is no multiple
    of the steps a call ends it at that length: the tokens a call a step gives."""
    pair = hosted_pair(target_model, eagle_draft)
    prompts = random_prompts(42, 2)
    reference = [greedy_reference(target_model, p, 24) for p in prompts]
    stop = reference[0][10]
    expected = reference[0][: reference[0].index(stop) + 1]
    for further in (0, 7):
        out, _ = decode_by_hand(pair, prompts[:1], 2, further, stop_token_ids=frozenset({stop}))
        assert out == [expected]
        out, _ = decode_by_hand(pair, prompts, 2, further, max_new_tokens=13)
        assert out == [r[:13] for r in reference]


def test_only_items_that_ask_go_further_and_each_stays_within_its_tokens(target_model, eagle_draft):
    """Of three sequences decoding at k = 0 in one call of 5 further steps, the one without
    ``further`` takes one step, one allowed 4 tokens takes 4, the third all 6; every step's verdict
    carries its sequence's features, the tokens are greedy decoding's, and the target holds what
    the verdicts say."""
    from specbatch.protocol.sampling_params import SamplingParams

    target, _, client, _ = hosted_pair(target_model, eagle_draft)
    prompts = random_prompts(43, 3)
    sampling = [SamplingParams()] * 3
    reply = client.verify([Call(f"s{i}", 0, p) for i, p in enumerate(prompts)], [[]] * 3, sampling, create=True,
                          return_features=True)
    firsts = [v.next_token for v in reply.verdicts]
    calls = [Call(f"s{i}", len(p), [t]) for i, (p, t) in enumerate(zip(prompts, firsts))]
    reply = client.verify(calls, [[]] * 3, sampling, return_features=True, further_steps=5,
                          further=[None, (4, 512, []), (100, 512, [])])
    taken = {v.seq_id: 1 for v in reply.verdicts}
    for step in reply.further_steps:
        for verdict in step.verdicts:
            taken[verdict.seq_id] += 1
            assert len(verdict.features) == 2 * target_model.config.hidden_size  # one float16 row
    assert taken == {"s0": 1, "s1": 4, "s2": 6}
    for i, p in enumerate(prompts):
        assert target.length(f"s{i}") == len(p) + taken[f"s{i}"]
    tokens = [v.next_token for v in reply.verdicts if v.seq_id == "s2"]
    tokens += [v.next_token for step in reply.further_steps for v in step.verdicts if v.seq_id == "s2"]
    assert [firsts[2], *tokens] == greedy_reference(target_model, prompts[2], 7)


class TimedK(FixedK):
    """A fixed k that keeps the step times it is told (as goodput:live learns from them)."""

    def __init__(self, k: int):
        super().__init__(k)
        object.__setattr__(self, "times", [])

    def observe_times(self, times) -> None:
        self.times.append(times)


class SlowFurtherSteps(InProcessTarget):
    """A target whose further steps each compute ``seconds`` more (it sleeps them after the call):
    far more than a step of the tiny models, so the first step's time cannot hold them."""

    seconds = 0.25

    def _send(self, method: str, request, timeout: float):
        reply = super()._send(method, request, timeout)
        if method == "Verify":
            for step in reply.further_steps:
                step.compute_seconds += self.seconds
                time.sleep(self.seconds)
        return reply


def test_a_policy_is_told_each_step_of_a_call_its_own_time(target_model, eagle_draft):
    """The first step of a call of several is priced as the call less its further steps' compute,
    each further step as its own compute: never the further steps twice off the first (which
    priced the k that goes further below its cost: a step a fraction of its time, or less than
    nothing)."""
    target, draft, client, draft_client = hosted_pair(target_model, eagle_draft)
    slow = SlowFurtherSteps(client.servicer, address="hosted")
    policy = TimedK(0)
    request = greedy_request("r", random_prompts(46, 1)[0], 13)
    speculation = SpeculationConfig(k_policy="fixed:0", leaves=0, prompt_lookup=0, shared_lookup=0)
    with stepped_by_hand(slow, draft_client, [request], policy, speculation, 512, draft.feature_size) as scheduler:
        while request.finish is None:
            told = len(policy.times)
            scheduler.step(3)
            steps = policy.times[told:]
            if len(steps) > 1:  # a call with further steps: its first step holds none of their time
                assert 0.0 <= steps[0].target_ms < 1e3 * SlowFurtherSteps.seconds
                assert all(t.target_ms >= 1e3 * SlowFurtherSteps.seconds for t in steps[1:])
    assert len(policy.times) > 4 and all(t.step_ms >= t.target_ms >= 0.0 for t in policy.times)


class ScriptedK(AllLeaves):
    """Call by call, the k (and whether it is a probe) of a script; keeps the step times it is told."""

    def __init__(self, script: list[tuple[int, bool]]):
        self.script, self.call, self.times = script, 0, []

    def k_for(self, batch_size: int) -> int:
        return self.script[self.call][0]

    def probing(self, batch_size: int) -> bool:
        return self.script[self.call][1]

    def observe(self, outcomes) -> None:
        pass

    def observe_times(self, times) -> None:
        self.times.append(times)

    def describe(self) -> str:
        return "scripted"


def test_a_probe_takes_one_step_a_call_and_a_new_best_k_goes_further(target_model, eagle_draft):
    """A policy's probe is measured as one step; a k that changes because another is now priced
    best goes on for further steps at once (a step a call there cost every change a call's
    overhead). The tokens stay greedy decoding's."""
    target, draft, client, draft_client = hosted_pair(target_model, eagle_draft)
    prompt = random_prompts(47, 1)[0]
    script = [(2, False), (2, False), (1, False), (3, True), (1, False), (2, False), (0, True), (2, False)]
    policy = ScriptedK(script)
    request = greedy_request("r", prompt, 80)
    speculation = SpeculationConfig(k_policy="fixed:0", leaves=0, prompt_lookup=0, shared_lookup=0)
    steps_a_call = []
    with stepped_by_hand(client, draft_client, [request], policy, speculation, 512, draft.feature_size) as scheduler:
        for policy.call in range(len(script)):
            told = len(policy.times)
            scheduler.step(3)
            steps_a_call.append(len(policy.times) - told)
    # The first drafting call has no proposal made ahead, nor has the call after a step at k = 0.
    assert steps_a_call == [1, 4, 4, 1, 4, 4, 1, 1]
    assert request.history[len(prompt):] == greedy_reference(target_model, prompt, len(request.history) - len(prompt))


def test_further_steps_out_of_range_are_refused_and_change_nothing(target_model, eagle_draft):
    from specbatch.protocol.sampling_params import SamplingParams

    target, _, client, _ = hosted_pair(target_model, eagle_draft)
    prompt = random_prompts(44, 1)[0]
    reply = client.verify([Call("s", 0, prompt)], [[]], [SamplingParams()], create=True)
    held = target.length("s")
    call = Call("s", len(prompt), [reply.verdicts[0].next_token])
    for further, steps in (((8, 64, []), MAX_FURTHER_STEPS + 1), ((0, 64, []), 2), ((8, 0, []), 2)):
        with pytest.raises(grpc.RpcError) as refused:
            client.verify([call], [[]], [SamplingParams()], further=[further], further_steps=steps)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert target.length("s") == held


def test_seeded_sampled_requests_stream_the_same_tokens_whatever_the_steps_a_call(target_model, eagle_draft,
                                                                                 tokenizer):
    """Served (the scheduler's own loop): sampled requests draw each token from (seed, position),
    so several steps a call stream what one a call does, drafts and all."""
    requests = [make_request(p, 24, temperature=0.9, top_p=0.95, seed=200 + i, k=2, ignore_eos=True)
                for i, p in enumerate(random_prompts(45, 3))]
    outputs = {}
    for steps in (1, 4):
        stack = start_local_stack(target_model, eagle_draft, tokenizer, max_batch_size=8, max_new_tokens=64,
                                  draft_in_target=True, speculation=SpeculationConfig(steps_per_call=steps))
        try:
            outputs[steps] = [r.token_ids for r in generate_all(stack.client(), requests)]
        finally:
            stack.stop()
    assert outputs[4] == outputs[1]
    assert all(len(tokens) == 24 for tokens in outputs[1])
