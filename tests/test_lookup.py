"""Prompt lookup (coordinator/lookup.py): drafts copied from a request's own history (or, with a
shared index, from finished requests' texts), verified like any draft. The indexes find what a scan
finds; output stays target-only decoding; lookup steps make no Propose; bad values are refused. (Sampled requests: the distribution test
in tests/test_speculative_sampling.py, ``copied``.)"""

from __future__ import annotations

import random

import grpc
import pytest
from test_eagle import distilled, eagle_draft  # noqa: F401 (fixtures)
from tiny import VOCAB, decode_while_the_draft_forgets, greedy_reference

from coordinator.lookup import (
    LONGEST,
    SHARED_LONGEST,
    SHARED_OCCURRENCES,
    SHARED_SHORTEST,
    SHORTEST,
    PromptLookup,
    SharedLookup,
    agreed,
)
from specbatch.config.speculation import SpeculationConfig
from specbatch.rpc.client import generate, generate_all, make_request


def scanned(history: list[int], most: int) -> list[int]:
    """The definition: the longest suffix (LONGEST down to SHORTEST tokens) that occurred earlier,
    at its latest earlier occurrence, and what followed it there."""
    for n in range(min(LONGEST, len(history)), SHORTEST - 1, -1):
        suffix = history[-n:]
        for end in range(len(history) - 1, n - 1, -1):
            if history[end - n : end] == suffix:
                return history[end : end + most]
    return []


def test_the_index_finds_what_a_scan_finds_as_the_history_grows():
    rng = random.Random(3)
    for trial in range(40):
        history, lookup, found = [], PromptLookup(), 0
        for _ in range(120):
            history.append(rng.randrange(4 if trial % 2 else 9))  # small alphabets repeat often
            most = rng.randrange(0, 7)
            got = lookup.drafts(history, most)
            assert got == (scanned(history, most) if most else []), (history, most)
            found += bool(got)
        assert found > 10


def test_a_lookup_copies_the_latest_longest_match():
    history = [5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7]
    # [5, 6, 7] occurred at the start (followed by 8); [6, 7] last occurred followed by 9: longest wins.
    assert PromptLookup().drafts(history, 3) == [8, 1, 6]
    assert PromptLookup().drafts([1, 2, 3, 4], 3) == []  # nothing repeats
    assert PromptLookup().drafts([1, 2, 1, 2], 4) == [1, 2]  # as far as the history goes


def repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts with a phrase said twice, so that lookup finds matches from the start."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        phrase = [rng.randrange(5, VOCAB) for _ in range(rng.randrange(3, 8))]
        out.append([1] + phrase + [rng.randrange(5, VOCAB)] + phrase[:-1])
    return out


@pytest.mark.parametrize("eagle", [False, True])
def test_greedy_output_with_prompt_lookup_matches_generate_and_skips_proposes(target_model, draft_model, eagle_draft,
                                                                              tokenizer, eagle):
    """A mixed batch through the services, some requests looking up (the coordinator's flag), one
    not (its own prompt_lookup = 0), one target-only: every output is target-only decoding, token
    for token; some steps drafted by lookup, the others still asked the draft."""
    from specbatch.stack.in_process import start_local_stack

    stack = start_local_stack(target_model, eagle_draft if eagle else draft_model, tokenizer, max_batch_size=4,
                              max_new_tokens=64, speculation=SpeculationConfig(prompt_lookup=4))
    try:
        batch = repetitive_prompts(seed=7, count=6)
        options = [{}] * 4 + [{"prompt_lookup": 0}, {"k": 0}]
        results = generate_all(stack.client(), [make_request(p, 30, ignore_eos=True, **({"k": 2} | o))
                                                for p, o in zip(batch, options)], concurrency=6)
        for prompt, result in zip(batch, results):
            assert result.token_ids == greedy_reference(target_model, prompt, 30)
        totals = stack.coordinator.scheduler.totals
        assert totals.lookup_chains > 0 and 0 < totals.lookup_accepted <= totals.lookup_drafted, vars(totals)
        assert sum(totals.reached_by_position) > 0  # the draft still drafted where lookup found nothing
        assert not stack.draft_engines[0].sequences and not stack.target_engines[0].sequences
    finally:
        stack.stop()


def test_sampled_requests_look_up_too(target_model, draft_model, tokenizer):
    """Seeded sampled requests with lookup on run to their length and draw the same tokens each
    time (their distribution: tests/test_speculative_sampling.py)."""
    from specbatch.stack.in_process import start_local_stack

    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=4, max_new_tokens=64, speculation=SpeculationConfig(prompt_lookup=4))
    try:
        prompt = repetitive_prompts(seed=9, count=1)[0]
        runs = [generate(stack.client(), make_request(prompt, 30, k=2, leaves=0, ignore_eos=True, temperature=0.3,
                                                        seed=4))
                for _ in range(2)]
        assert len(runs[0].token_ids) == 30 and runs[0].token_ids == runs[1].token_ids
        assert stack.coordinator.scheduler.totals.lookup_chains > 0
    finally:
        stack.stop()


def test_a_prompt_lookup_out_of_range_is_refused(target_model, draft_model, tokenizer):
    from specbatch.stack.in_process import start_local_stack

    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=4, max_new_tokens=64)
    try:
        for bad in (-1, 17):
            with pytest.raises(grpc.RpcError) as error:
                generate(stack.client(), make_request([1, 5, 6], 4, prompt_lookup=bad))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_lookup" in error.value.details()
    finally:
        stack.stop()
    with pytest.raises(ValueError, match="prompt_lookup"):
        SpeculationConfig(prompt_lookup=99).check()


def test_a_draft_that_forgets_its_sequences_between_looked_up_steps_costs_no_token(target_model, eagle_draft,
                                                                                   tokenizer):
    """Steps drafted by lookup leave the draft untouched (its lease is not renewed); a draft that
    lost the sequence meanwhile is rebuilt from the history at the next Propose, and the output
    is still target-only decoding."""
    from specbatch.stack.in_process import start_local_stack

    stack = start_local_stack(target_model, eagle_draft, tokenizer, max_batch_size=4, max_new_tokens=64, speculation=SpeculationConfig(prompt_lookup=4))
    try:
        responses = decode_while_the_draft_forgets(stack, target_model, repetitive_prompts(seed=11, count=1)[0])
        totals = stack.coordinator.scheduler.totals
        assert responses > 6 and totals.lookup_chains > 0
        assert sum(totals.reached_by_position) > 0
    finally:
        stack.stop()


# ---- shared lookup ---------------------------------------------------------------------------------


def scanned_shared(texts: list[list[int]], history: list[int], most: int) -> list[int]:
    """The definition: the latest SHARED_OCCURRENCES occurrences of the history's last
    SHARED_SHORTEST tokens in the texts (each with a token after it), the longest of their matches
    with the history (up to SHARED_LONGEST), and the tokens their continuations agree on (the
    vote itself: the worked examples in the next test)."""
    if most <= 0 or len(history) < SHARED_SHORTEST:
        return []
    key = history[-SHARED_SHORTEST:]
    found = [(text, end) for text in texts for end in range(SHARED_SHORTEST, len(text))
             if text[end - SHARED_SHORTEST : end] == key][-SHARED_OCCURRENCES:]

    def match(text, end):
        n = SHARED_SHORTEST
        while n < min(SHARED_LONGEST, len(history)) and n < end and text[end - n - 1] == history[-n - 1]:
            n += 1
        return n

    if not found:
        return []
    longest = max(match(t, e) for t, e in found)
    return agreed([t[e : e + most] for t, e in found if match(t, e) == longest], most)


def test_shared_lookup_finds_what_a_scan_finds_as_texts_come_and_go():
    rng = random.Random(5)
    hits = 0
    for trial in range(30):
        budget = rng.choice([40, 120, 10_000])
        shared, kept = SharedLookup(budget), []
        for _ in range(25):
            text = [rng.randrange(3 if trial % 2 else 6) for _ in range(rng.randrange(2, 30))]
            shared.add(text)
            if len(text) > SHARED_SHORTEST:
                kept.append(text[-budget:])
                while sum(map(len, kept)) > budget:
                    kept.pop(0)
            assert shared.tokens == sum(map(len, kept)) <= budget
            for _ in range(4):
                history = [rng.randrange(3 if trial % 2 else 6) for _ in range(rng.randrange(0, 12))]
                most = rng.randrange(0, 7)
                got = shared.drafts(history, most)
                assert got == scanned_shared(kept, history, most), (kept, history, most)
                hits += bool(got)
        # What is indexed is what is kept: no key or occurrence outlives its text.
        live = set(shared.texts)
        assert all(occurrences and all(o >> 32 in live for o in occurrences) for occurrences in shared.ends.values())
        assert set(shared.ends) == {tuple(t[e - SHARED_SHORTEST : e]) for t in kept
                                    for e in range(SHARED_SHORTEST, len(t))}
    assert hits > 100


def test_shared_lookup_takes_the_longest_match_and_what_the_matches_agree_on():
    shared = SharedLookup(1000)
    shared.add([8, 2, 3, 4, 5, 6])
    shared.add([7, 2, 3, 4, 9, 9])
    assert shared.drafts([1, 7, 2, 3, 4], 3) == [9, 9]  # [7, 2, 3, 4] beats the later-added [2, 3, 4]
    assert shared.drafts([1, 0, 2, 3, 4], 3) == [5, 6]  # a tie of two 3-token matches: the first most common
    split = SharedLookup(1000)
    for tail in ([10], [11], [12]):
        split.add([1, 2, 3] + tail)
    assert split.drafts([0, 1, 2, 3], 2) == []  # no first token backed by half of the matches
    chains = SharedLookup(1000)
    for tail in ([5, 6, 7], [5, 6, 8], [5, 9, 1], [5, 9, 2], [5, 9, 3]):
        chains.add([1, 2, 3] + tail)
    # 5 (all five), then 9 (3 of 5: support 0.6), then no token with a third of the rest (0.2 < 0.25)
    assert chains.drafts([0, 1, 2, 3], 4) == [5, 9]
    assert SharedLookup(1000).drafts([1, 2, 3], 4) == []  # empty index


def test_shared_lookup_drafts_from_finished_requests_and_output_is_unchanged(target_model, draft_model,
                                                                           tokenizer):
    """A second request with the same prompt drafts from the first one's text (the shared index),
    and its output is still target-only decoding; a request kept out of the index neither drafts
    from it nor joins it."""
    from specbatch.stack.in_process import start_local_stack

    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=4, max_new_tokens=64, speculation=SpeculationConfig(prompt_lookup=4, shared_lookup=10_000))
    try:
        client, shared = stack.client(), stack.coordinator.scheduler.decode.shared.index
        prompt = [1, 17, 23, 42, 8, 31]  # no token repeats: the request's own lookup finds nothing at first
        reference = greedy_reference(target_model, prompt, 24)
        out = generate(client, make_request(prompt, 24, k=2, ignore_eos=True, shared_lookup=False)).token_ids
        totals = stack.coordinator.scheduler.totals
        assert out == reference and totals.shared_lookup_chains == 0 and shared.tokens == 0  # kept out
        assert generate(client, make_request(prompt, 24, k=2, ignore_eos=True)).token_ids == reference
        assert totals.shared_lookup_chains == 0 and shared.tokens == len(prompt) + 24  # now in the index
        assert generate(client, make_request(prompt, 24, k=2, ignore_eos=True)).token_ids == reference
        assert 0 < totals.shared_lookup_accepted <= totals.shared_lookup_drafted
        assert totals.shared_lookup_chains <= totals.lookup_chains
    finally:
        stack.stop()


def test_who_is_in_the_shared_index_by_default():
    """Everyone unless kept out, but a sampled request with a seed of its own: its tokens follow
    from its seed, k and the draft, and must not follow from other requests' texts too."""
    from coordinator.admission import in_shared_lookup

    assert in_shared_lookup(make_request([1, 2], 4))
    assert in_shared_lookup(make_request([1, 2], 4, temperature=0.7))  # its seed is drawn at admission
    assert not in_shared_lookup(make_request([1, 2], 4, temperature=0.7, seed=3))
    assert in_shared_lookup(make_request([1, 2], 4, temperature=0.7, seed=3, shared_lookup=True))
    assert not in_shared_lookup(make_request([1, 2], 4, shared_lookup=False))


def test_a_seeded_sampled_request_gives_the_same_tokens_whatever_the_shared_index_holds(target_model,
                                                                                       draft_model, tokenizer):
    from specbatch.stack.in_process import start_local_stack

    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=4, max_new_tokens=64, speculation=SpeculationConfig(prompt_lookup=4, shared_lookup=10_000))
    try:
        client, totals = stack.client(), stack.coordinator.scheduler.totals
        prompt = [1, 17, 23, 42, 8, 31]
        seeded = make_request(prompt, 24, k=2, leaves=0, ignore_eos=True, temperature=0.8, seed=11)
        before = generate(client, seeded).token_ids
        for _ in range(2):  # the index now holds this prompt's greedy answer, twice
            generate(client, make_request(prompt, 24, k=2, ignore_eos=True))
        chains = totals.shared_lookup_chains
        assert chains > 0  # the second greedy request drafted from the first
        assert generate(client, seeded).token_ids == before and totals.shared_lookup_chains == chains
    finally:
        stack.stop()


def test_a_shared_lookup_size_out_of_range_is_refused():
    with pytest.raises(ValueError, match="shared_lookup"):
        SpeculationConfig(shared_lookup=-1).check()
    SpeculationConfig(shared_lookup=100_000).check()
