"""distill's evaluation (and the draft benchmarks) decode through the coordinator's own scheduler
and step, over the services' servicers in process (coordinator/in_process.py)."""

from __future__ import annotations

import copy

import grpc
import pytest
from test_eagle import distilled, eagle_draft  # noqa: F401 (fixtures)
from tiny import random_prompts

from coordinator.backends import Call, lost_state
from coordinator.in_process import InProcessTarget
from specbatch.commands.distill.evaluate import speculate, speculative_steps
from specbatch.engine.engine import Engine
from specbatch.protocol.sampling_params import SamplingParams
from target_service.servicer import TargetServicer


def by_prompt(steps, prompts: int) -> list[list]:
    """The steps of each prompt, in order."""
    out, done = [], []

    def prompt_done():
        out.append(list(done))
        done.clear()

    for step in steps(prompt_done):
        done.append(step)
    assert len(out) == prompts
    return out


def test_a_draft_equal_to_the_target_is_accepted_whole_and_k_keeps_within_the_answer(target_model):
    """Every draft accepted; each prompt yields exactly its new tokens (the first from the prefill),
    k shrinking where the answer has less room left, as served; the sequences are released."""
    target, draft = Engine(target_model, max_sequences=2), Engine(copy.deepcopy(target_model), max_sequences=2)
    prompts = random_prompts(3, count=3)
    steps = by_prompt(lambda done: speculative_steps(target, draft, prompts, 3, 12, set(), done), len(prompts))
    for prompt_steps in steps:
        assert [(s.drafted, s.accepted) for s in prompt_steps] == [(3, 3), (3, 3), (2, 2)]  # 1 + 4 + 4 + 3 tokens
        assert not any(s.read_prompt for s in prompt_steps)  # a plain draft caches the prompt beside the target
    assert not target.sequences and not draft.sequences
    evaluation = speculate(target_model, copy.deepcopy(target_model), prompts, 3, 12, set())
    assert evaluation.acceptance == 1.0 and evaluation.acceptance_by_position == [1.0, 1.0, 1.0]
    assert (evaluation.steps, evaluation.tokens) == (9, 33)


def test_a_draft_that_reads_features_reads_the_prompt_at_its_first_propose(target_model, eagle_draft):
    target, draft = Engine(target_model, max_sequences=2), Engine(eagle_draft, max_sequences=2)
    prompts = random_prompts(4, count=2)
    steps = by_prompt(lambda done: speculative_steps(target, draft, prompts, 3, 10, set(), done), len(prompts))
    for prompt_steps in steps:
        assert [s.read_prompt for s in prompt_steps] == [True] + [False] * (len(prompt_steps) - 1)
        assert sum(s.accepted + 1 for s in prompt_steps) == 10 - 1
        assert all(0 <= s.accepted <= s.drafted <= 3 for s in prompt_steps)
        assert all(s.next_token is not None for s in prompt_steps if s.accepted < s.drafted)


def test_an_in_process_service_fails_as_a_remote_one(target_model):
    """A servicer's abort reaches the caller as the grpc.RpcError its code names: a sequence the
    target does not hold is lost state, which the coordinator rebuilds from history."""
    client = InProcessTarget(TargetServicer(Engine(target_model, max_sequences=2), "target"))
    assert client.cache_stats().model == "target"
    with pytest.raises(grpc.RpcError) as raised:
        client.verify([Call("unknown", 4, [5, 6])], [[]], [SamplingParams()])
    assert lost_state(raised.value)
    reply = client.verify([Call("known", 0, [5, 6, 7])], [[]], [SamplingParams()], create=True)
    assert reply.verdicts[0].cached_len == 3 and client.traffic.calls == 1
