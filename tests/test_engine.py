"""The engine in process, without gRPC: ragged batches, rollback, no prefix recompute, the draft's
proposals, refusals that change nothing, and release."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import VOCAB, greedy_reference, hooked_forwards

from draft_service.proposer import MAX_K, ProposeItem, propose
from specbatch.engine import batch as batch_module
from specbatch.engine.batch import PADDED_ROWS_FREE, PADDED_ROWS_PER_TOKEN, SequenceInput, length_groups, right_aligned
from specbatch.engine.engine import Engine
from specbatch.engine.sampling import SamplingParams
from specbatch.protocol.errors import CapacityExceeded, InvalidRequest, StaleCache, UnknownSequence
from target_service.verifier import VerifyItem, verify


def random_prompts(lengths, seed):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(5, VOCAB) for _ in range(n - 1)] for n in lengths]


def wrong_token(rng: random.Random, right: int) -> int:
    token = rng.randrange(VOCAB)
    while token == right:
        token = rng.randrange(VOCAB)
    return token


class Decoding:
    """One sequence decoded through `verify` the way the coordinator does it."""

    def __init__(self, seq_id: str, prompt: list[int], reference: list[int], cached: int):
        self.seq_id, self.prompt, self.reference = seq_id, prompt, reference
        self.history = list(prompt)
        self.cached = cached  # tokens of history the engine holds

    @property
    def generated(self) -> list[int]:
        return self.history[len(self.prompt):]

    @property
    def done(self) -> bool:
        return len(self.generated) >= len(self.reference)


def verify_steps(engine: Engine, decodings: list[Decoding], rng: random.Random, create_first: bool = False,
                 max_steps: int = 200, leaves: bool = False) -> dict[str, int]:
    """Drive every unfinished sequence with `verify` until each has its reference's length.

    Per step and sequence, k cycles through 0..4 (so a call mixes draft lengths, zero included);
    drafts come from the reference and are either all right or wrong from a random position on.
    With ``leaves``, drafted positions get 0-3 wrong leaves each, and at a rejected position the
    right token is among them half the time (a leaf hit). Every verdict is checked against the
    reference. Returns counts of the paths exercised.
    """
    seen = {"full_accept": 0, "reject": 0, "no_drafts": 0, "leaf_hit": 0, "calls": 0, "batch_sizes": set()}
    for step in range(max_steps):
        live = [d for d in decodings if not d.done]
        if not live:
            break
        items, expected = [], []
        for i, d in enumerate(live):
            g = len(d.generated)
            k = min((step + i) % 5, len(d.reference) - g - 1)
            drafts = list(d.reference[g : g + k])
            right = k
            if k and rng.random() < 0.5:
                right = rng.randrange(k)
                drafts[right] = wrong_token(rng, d.reference[g + right])
                drafts[right + 1 :] = [rng.randrange(VOCAB) for _ in drafts[right + 1 :]]
            seen["no_drafts" if k == 0 else "full_accept" if right == k else "reject"] += 1
            at = []
            if leaves and k:
                for j in range(rng.randrange(k + 1)):
                    wrong = {wrong_token(rng, d.reference[g + j]) for _ in range(rng.randrange(4))} - {drafts[j]}
                    at.append(sorted(wrong))
                if right < len(at) and rng.random() < 0.5:
                    at[right].insert(rng.randrange(len(at[right]) + 1), d.reference[g + right])
            hit = right < len(at) and d.reference[g + right] in at[right]
            seen["leaf_hit"] += hit
            items.append(VerifyItem(SequenceInput(d.seq_id, d.cached, d.history[d.cached :]), drafts, leaves=at))
            expected.append((right, drafts, hit))
        verdicts = verify(engine, items, create=create_first and step == 0)
        seen["calls"] += 1
        seen["batch_sizes"].add(len(items))
        assert len(verdicts) == len(live)
        for d, verdict, (right, drafts, hit) in zip(live, verdicts, expected):
            g = len(d.generated)
            assert verdict.accepted == right, f"{d.seq_id} step {step}: drafts {drafts}"
            assert verdict.leaf == (d.reference[g + right] if hit else None), f"{d.seq_id} step {step}"
            assert verdict.next_token == d.reference[g + right + hit], f"{d.seq_id} step {step}"
            assert verdict.cached_len == len(d.history) + right + hit
            assert engine.length(d.seq_id) == verdict.cached_len
            d.history += drafts[:right] + [verdict.leaf] * hit + [verdict.next_token]
            d.cached = verdict.cached_len
    for d in decodings:
        assert d.generated == d.reference, d.seq_id
    return seen


def snapshot(engine: Engine) -> dict[str, tuple[int, torch.Tensor]]:
    return {sid: (c.length, c.kv[:, :, :, : c.length].clone()) for sid, c in engine.sequences.items()}


def assert_unchanged(engine: Engine, before: dict[str, tuple[int, torch.Tensor]]) -> None:
    assert set(engine.sequences) == set(before)
    for sid, (length, kv) in before.items():
        cache = engine.sequences[sid]
        assert cache.length == length, sid
        assert torch.equal(cache.kv[:, :, :, :length], kv), sid


def record_forwards(engine):
    """Record what each forward of `engine` is fed; returns (records, a context that records)."""
    records = []
    return records, hooked_forwards(engine, lambda fed: records.append({k: v.detach().cpu().clone()
                                                                        for k, v in fed.items()}))


# ---- exactness over a ragged batch ---------------------------------------------------------------


def test_calls_of_very_different_lengths_split_into_forwards_of_similar_ones():
    """Longest first, each forward padded to at most PADDED_ROWS_PER_TOKEN times its tokens, or
    PADDED_ROWS_FREE rows past them: a step's few rows never split."""
    lengths = [31, 219, 60, 49, 31, 202, 100, 97]
    groups = length_groups(lengths)
    assert groups == [[1, 5], [2, 6, 7], [0, 3, 4]]
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        rows, tokens = len(g) * max(lengths[i] for i in g), sum(lengths[i] for i in g)
        assert rows <= PADDED_ROWS_PER_TOKEN * tokens or rows - tokens <= PADDED_ROWS_FREE
    assert length_groups([1, 4, 4, 2, 5]) == [[0, 1, 2, 3, 4]]  # a verify step's chains: one forward
    assert length_groups([200] + [4] * 31) == [[0], list(range(1, 32))]  # a prompt beside a step
    assert length_groups(lengths, by_length=False) == [list(range(8))]


def test_a_grouped_prefill_caches_what_one_call_would(target_model):
    """Sequences of very different lengths prefilled in one call (run as several forwards) hold
    bitwise the keys and values, and verify to the same tokens, as each prefilled alone; through
    Verify too, with the same first tokens and features, the slots in the call's order; a call
    refused for room creates none of them."""
    prompts = random_prompts([3, 90, 7, 85, 1, 40], seed=9)
    together, alone = Engine(target_model, max_sequences=8), Engine(target_model, max_sequences=8)
    assert together.prefill([SequenceInput(f"s{i}", 0, p) for i, p in enumerate(prompts)]) == [len(p) for p in prompts]
    assert together.sequences_created == len(prompts)
    for i, p in enumerate(prompts):
        alone.prefill([SequenceInput(f"s{i}", 0, p)])
    for i, p in enumerate(prompts):
        a, b = together.sequences[f"s{i}"], alone.sequences[f"s{i}"]
        assert a.length == b.length == len(p)
        assert torch.equal(together.pool.kv[:, :, a.slot, :, : len(p)], alone.pool.kv[:, :, b.slot, :, : len(p)])
    items = [VerifyItem(SequenceInput(f"s{i}", len(p), [5]), [6, 7]) for i, p in enumerate(prompts)]
    assert [v.next_token for v in verify(together, items)] == [v.next_token for v in verify(alone, items)]
    # The coordinator prefills through Verify (it yields the first token): the same verdicts and features.
    fresh, one_by_one = Engine(target_model, max_sequences=8), Engine(target_model, max_sequences=8)
    firsts = verify(fresh, [VerifyItem(SequenceInput(f"s{i}", 0, p)) for i, p in enumerate(prompts)], create=True,
                    return_features=True)
    for i, (p, verdict) in enumerate(zip(prompts, firsts)):
        (expected,) = verify(one_by_one, [VerifyItem(SequenceInput(f"s{i}", 0, p))], create=True, return_features=True)
        assert (verdict.next_token, verdict.cached_len) == (expected.next_token, expected.cached_len) == (
            expected.next_token, len(p))
        assert torch.equal(verdict.features, expected.features)
    assert [fresh.sequences[f"s{i}"].slot for i in range(len(prompts))] == list(range(len(prompts)))
    full = Engine(target_model, max_sequences=2)
    with pytest.raises(CapacityExceeded):
        full.prefill([SequenceInput(f"s{i}", 0, p) for i, p in enumerate(prompts)])
    assert not full.sequences


def test_ragged_verify_batch_matches_generate(target_model):
    engine = Engine(target_model)
    lengths = [2, 7, 16, 33, 4]
    prompts = random_prompts(lengths, seed=1)
    new_tokens = [24, 30, 18, 26, 21]
    refs = [greedy_reference(target_model, p, n) for p, n in zip(prompts, new_tokens)]
    # Sequences 0-3 are prefilled with different parts of their prompts (so the first verify feeds
    # 1 to 13 uncached prompt tokens plus drafts); sequence 4 is created by the first verify call.
    prefilled = [1, 5, 15, 20]
    lengths_after = engine.prefill([SequenceInput(f"s{i}", 0, prompts[i][:m]) for i, m in enumerate(prefilled)])
    assert lengths_after == prefilled
    assert [engine.length(f"s{i}") for i in range(4)] == prefilled
    decodings = [Decoding(f"s{i}", prompts[i], refs[i], prefilled[i] if i < 4 else 0) for i in range(5)]
    seen = verify_steps(engine, decodings, random.Random(7), create_first=True)
    assert seen["full_accept"] > 0 and seen["reject"] > 0 and seen["no_drafts"] > 0
    assert max(seen["batch_sizes"]) == 5 and min(seen["batch_sizes"]) < 5  # sequences finished at different steps
    # Each sequence holds its whole history but the last token (fed on the next step).
    for d in decodings:
        assert engine.length(d.seq_id) == len(d.history) - 1


def test_leaves_keep_greedy_output_exact_and_the_cache_right(target_model):
    """Verify calls with leaves beside the chain: where the target's token at the rejected position
    is a leaf, the verdict keeps it and the token after it, and what follows (its keys/values moved
    to the chain's column, the other leaves dropped) decodes on exactly as the reference; in
    contiguous and gathered batches alike."""
    engine = Engine(target_model)
    prompts = random_prompts([3, 9, 17, 5, 12], seed=4)
    refs = [greedy_reference(target_model, p, 28) for p in prompts]
    engine.prefill([SequenceInput("blocker", 0, [1, 2])])  # slot 0: later calls over s1.. gather or view
    decodings = [Decoding(f"s{i}", p, r, 0) for i, (p, r) in enumerate(zip(prompts, refs))]
    seen = verify_steps(engine, decodings, random.Random(11), create_first=True, leaves=True)
    assert seen["leaf_hit"] >= 5 and seen["reject"] > seen["leaf_hit"]
    engine.release(["blocker"])
    decodings = [Decoding(f"t{i}", p, r, 0) for i, (p, r) in enumerate(zip(prompts, refs))]
    assert verify_steps(engine, decodings, random.Random(12), create_first=True, leaves=True)["leaf_hit"] >= 3


def test_leaves_that_repeat_a_token_are_refused(target_model):
    engine = Engine(target_model)
    engine.prefill([SequenceInput("a", 0, [1, 5, 6])])
    for drafts, leaves in (([7, 8], [[9, 9]]), ([7, 8], [[7]]), ([7], [[9], [10]])):
        with pytest.raises(InvalidRequest):
            verify(engine, [VerifyItem(SequenceInput("a", 3, [7]), drafts, leaves=leaves)])
    assert engine.length("a") == 3


def test_verify_without_prefill_or_create_is_refused(target_model):
    engine = Engine(target_model)
    with pytest.raises(UnknownSequence, match="new"):
        verify(engine, [VerifyItem(SequenceInput("new", 0, [1, 5, 6]))], create=False)
    assert not engine.sequences


# ---- rollback ------------------------------------------------------------------------------------


def logits_of(engine: Engine, seq_id: str, keep_len: int, tokens: list[int]) -> torch.Tensor:
    batch = engine.start([SequenceInput(seq_id, keep_len, tokens)])
    logits = batch.prefill(len(tokens))
    batch.commit(batch.fed)
    return logits[0]


def test_rollback_then_continue_equals_never_going_further(target_model):
    engine = Engine(target_model)
    prompt = random_prompts([12], seed=3)[0]
    ref = greedy_reference(target_model, prompt, 20)
    junk = [wrong_token(random.Random(i), ref[0]) for i in range(9)]

    engine.prefill([SequenceInput("went_further", 0, prompt + junk)])
    engine.prefill([SequenceInput("never", 0, prompt[:-1])])
    assert engine.length("went_further") == len(prompt) + len(junk)
    assert engine.rollback("went_further", len(prompt) - 1) == len(prompt) - 1
    assert engine.length("went_further") == len(prompt) - 1

    cont = [prompt[-1]] + ref[:5]
    rolled = logits_of(engine, "went_further", len(prompt) - 1, cont)
    straight = logits_of(engine, "never", len(prompt) - 1, cont)
    assert rolled.shape == (len(cont), VOCAB)
    assert torch.allclose(rolled, straight, atol=1e-5)
    assert rolled.argmax(-1).tolist() == ref[:6]

    # Rolling back through keep_len (no rollback call) works the same: go 4 tokens too far, then
    # keep only the real history and continue decoding to the reference's end.
    assert engine.length("went_further") == len(prompt) + 5
    engine.prefill([SequenceInput("went_further", len(prompt) + 5, junk[:4])])
    assert engine.length("went_further") == len(prompt) + 9
    d = Decoding("went_further", prompt, ref, cached=len(prompt) + 5)
    d.history += ref[:6]
    verify_steps(engine, [d], random.Random(5))
    assert d.generated == ref

    # Truncating to 0 and refeeding the prompt from scratch also matches.
    engine.rollback("never", 0)
    assert engine.length("never") == 0
    verdict, = verify(engine, [VerifyItem(SequenceInput("never", 0, prompt), ref[:3])])
    assert (verdict.accepted, verdict.next_token, verdict.cached_len) == (3, ref[3], len(prompt) + 3)


def test_rollback_beyond_cached_is_refused(target_model):
    engine = Engine(target_model)
    prompt = random_prompts([9], seed=4)[0]
    engine.prefill([SequenceInput("a", 0, prompt)])
    before = snapshot(engine)
    for bad in (len(prompt) + 1, 100, -1):
        with pytest.raises(InvalidRequest, match="roll back"):
            engine.rollback("a", bad)
        assert_unchanged(engine, before)
    with pytest.raises(UnknownSequence):
        engine.rollback("ghost", 0)
    # keep_len beyond what is cached: the caller's view is stale.
    with pytest.raises(StaleCache, match="keep_len"):
        engine.validate([SequenceInput("a", len(prompt) + 1, [5])], [0], create=False)
    with pytest.raises(StaleCache):
        verify(engine, [VerifyItem(SequenceInput("a", len(prompt) + 3, [5]))])
    # A sequence that is not cached at all cannot be asked to keep anything, even with create:
    # it is unknown here (as without create), and its caller re-sends it whole.
    with pytest.raises(UnknownSequence, match="keep_len 0"):
        engine.prefill([SequenceInput("fresh", 4, [5, 6])])
    assert_unchanged(engine, before)
    # keep_len equal to the cached length is fine.
    engine.validate([SequenceInput("a", len(prompt), [5])], [0], create=False)
    assert engine.rollback("a", len(prompt)) == len(prompt)


# ---- no prefix recompute -------------------------------------------------------------------------


def test_steps_feed_only_new_tokens_and_drafts(target_model):
    engine = Engine(target_model)
    prompts = random_prompts([5, 12, 20], seed=5)
    refs = [greedy_reference(target_model, p, 10) for p in prompts]
    records, recording = record_forwards(engine)
    with recording:
        engine.prefill([SequenceInput(f"s{i}", 0, p[:-1]) for i, p in enumerate(prompts)])
        assert len(records) == 1  # 4, 11 and 19 tokens: a few rows of padding, one forward (length_groups)
        assert tuple(records[0]["input_ids"].shape) == (3, 19)
        assert records[0]["attention_mask"].shape[-1] == 19  # nothing cached: only the new columns
        records.clear()

        ks = [3, 0, 2]
        items = [VerifyItem(SequenceInput(f"s{i}", len(p) - 1, [p[-1]]), refs[i][:k])
                 for i, (p, k) in enumerate(zip(prompts, ks))]
        verdicts = verify(engine, items)
        assert [v.accepted for v in verdicts] == ks
        assert [v.next_token for v in verdicts] == [r[k] for r, k in zip(refs, ks)]
        assert len(records) == 1  # one forward for the whole batch
        rec = records[0]
        width = rec["input_ids"].shape[1]
        assert tuple(rec["input_ids"].shape) == (3, 1 + max(ks))  # never a prefix column
        # The keys span each row's cached prefix plus its new tokens: the prefixes come from the cache.
        assert rec["attention_mask"].shape[-1] == max(len(p) - 1 + 1 + k for p, k in zip(prompts, ks))
        for row, item in enumerate(items):
            fed = item.seq.tokens + item.drafts
            n = len(fed)
            assert rec["input_ids"][row, -n:].tolist() == fed
            assert rec["position_ids"][row, -n:].tolist() == list(range(item.seq.keep_len, item.seq.keep_len + n))
            # The first fed token sees the cached prefix and itself; the last sees all of it.
            assert int(rec["attention_mask"][row, 0, width - n].sum()) == item.seq.keep_len + 1
            assert int(rec["attention_mask"][row, 0, -1].sum()) == item.seq.keep_len + n
        records.clear()

        # Next step: s0 accepted everything, s1 continues, s2 is rolled back by one token and
        # refeeds it (2 uncached tokens) with 4 drafts.
        histories = [p + r[: k + 1] for p, r, k in zip(prompts, refs, ks)]
        keeps = [verdicts[0].cached_len, verdicts[1].cached_len, verdicts[2].cached_len - 1]
        ks2 = [1, 2, 4]
        items = [VerifyItem(SequenceInput(f"s{i}", keep, histories[i][keep:]), refs[i][k + 1 : k + 1 + k2])
                 for i, (keep, k, k2) in enumerate(zip(keeps, ks, ks2))]
        verdicts = verify(engine, items)
        assert [v.accepted for v in verdicts] == ks2
        assert [v.next_token for v in verdicts] == [r[k + 1 + k2] for r, k, k2 in zip(refs, ks, ks2)]
        assert len(records) == 1
        rec = records[0]
        fed_counts = [len(i.seq.tokens) + len(i.drafts) for i in items]
        assert fed_counts == [2, 3, 6]
        assert tuple(rec["input_ids"].shape) == (3, max(fed_counts))
        assert rec["attention_mask"].shape[-1] == max(keep + n for keep, n in zip(keeps, fed_counts))
        width = rec["input_ids"].shape[1]
        for row, n in enumerate(fed_counts):
            assert int(rec["attention_mask"][row, 0, width - n].sum()) == keeps[row] + 1
            assert int(rec["attention_mask"][row, 0, -1].sum()) == keeps[row] + n
            assert rec["position_ids"][row, -n:].tolist() == list(range(keeps[row], keeps[row] + n))


# ---- the draft's proposals -----------------------------------------------------------------------


def test_propose_matches_draft_greedy_with_mixed_k(draft_model):
    engine = Engine(draft_model)
    prompts = random_prompts([6, 11, 3, 20], seed=6)
    refs = [greedy_reference(draft_model, p, 12) for p in prompts]
    engine.prefill([SequenceInput("p0", 0, prompts[0][:-1]), SequenceInput("p1", 0, prompts[1][:-3]),
                    SequenceInput("p3", 0, prompts[3][:-1])])
    seqs = [SequenceInput("p0", 5, prompts[0][5:]), SequenceInput("p1", 8, prompts[1][8:]),
            SequenceInput("p2", 0, prompts[2]),  # not cached yet: created by the call
            SequenceInput("p3", 19, prompts[3][19:])]
    ks = [1, 4, 3, 6]
    records, recording = record_forwards(engine)
    with recording:
        drafts = propose(engine, [ProposeItem(s, k) for s, k in zip(seqs, ks)])
    assert drafts == [r[:k] for r, k in zip(refs, ks)]
    # One ragged forward, then one one-token forward per further drafted position.
    assert [tuple(r["input_ids"].shape) for r in records] == [(4, 3)] + [(4, 1)] * (max(ks) - 1)
    for s, k in zip(seqs, ks):
        assert engine.length(s.seq_id) == s.keep_len + len(s.tokens) + k - 1

    # Second call: p0 and p1 keep drafts the target accepted, p2 and p3 had a draft rejected and
    # the target's token differs from the draft's; the call rolls each back through keep_len.
    w2 = wrong_token(random.Random(1), refs[2][0])
    w3 = wrong_token(random.Random(2), refs[3][1])
    histories = [prompts[0] + refs[0][:1], prompts[1] + refs[1][:3], prompts[2] + [w2],
                 prompts[3] + refs[3][:1] + [w3]]
    keeps = [len(prompts[0]), len(prompts[1]) + 2, len(prompts[2]), len(prompts[3]) + 1]
    ks2 = [5, 2, 4, 3]
    seqs = [SequenceInput(f"p{i}", keep, h[keep:]) for i, (keep, h) in enumerate(zip(keeps, histories))]
    assert [len(s.tokens) for s in seqs] == [1, 1, 1, 1]
    drafts = propose(engine, [ProposeItem(s, k) for s, k in zip(seqs, ks2)])
    assert drafts[0] == refs[0][1:6]
    assert drafts[1] == refs[1][3:5]
    assert drafts[2] == greedy_reference(draft_model, histories[2], 4)
    assert drafts[3] == greedy_reference(draft_model, histories[3], 3)
    for s, k in zip(seqs, ks2):
        assert engine.length(s.seq_id) == s.keep_len + len(s.tokens) + k - 1


def test_a_new_prompt_beside_steps_proposes_in_forwards_of_its_own(draft_model):
    """A sequence joining with its whole prompt beside others feeding a token or two: its
    forwards run apart (no 90-token padding for the others), with the same proposals."""
    engine = Engine(draft_model, max_sequences=8)
    prompts = random_prompts([12, 15, 9, 90], seed=8)
    refs = [greedy_reference(draft_model, p, 4) for p in prompts]
    engine.prefill([SequenceInput(f"q{i}", 0, p[:-1]) for i, p in enumerate(prompts[:3])])
    seqs = [SequenceInput(f"q{i}", len(p) - 1, p[-1:]) for i, p in enumerate(prompts[:3])]
    seqs.append(SequenceInput("q3", 0, prompts[3]))  # created by the call
    records, recording = record_forwards(engine)
    with recording:
        drafts = propose(engine, [ProposeItem(seq, 3) for seq in seqs])
    assert drafts == [r[:3] for r in refs]
    assert [tuple(r["input_ids"].shape) for r in records] == [(1, 90), (1, 1), (1, 1), (3, 1), (3, 1), (3, 1)]
    assert [engine.sequences[f"q{i}"].slot for i in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize("k", [0, MAX_K + 1])
def test_propose_refuses_k_out_of_range(draft_model, k):
    engine = Engine(draft_model)
    prompt = random_prompts([5], seed=8)[0]
    engine.prefill([SequenceInput("a", 0, prompt[:-1])])
    before = snapshot(engine)
    with pytest.raises(InvalidRequest, match="k must be"):
        propose(engine, [ProposeItem(SequenceInput("a", 4, [prompt[-1]]), 2),
                         ProposeItem(SequenceInput("b", 0, prompt), k)])
    assert_unchanged(engine, before)
    assert propose(engine, [ProposeItem(SequenceInput("a", 4, [prompt[-1]]), 3)])[0] == \
        greedy_reference(draft_model, prompt, 3)


# ---- refusals change nothing ---------------------------------------------------------------------


def test_refused_calls_leave_other_sequences_untouched(target_model):
    engine = Engine(target_model, max_context=64)
    prompts = random_prompts([9, 17], seed=9)
    refs = [greedy_reference(target_model, p, 24) for p in prompts]
    engine.prefill([SequenceInput("a", 0, prompts[0][:-1]), SequenceInput("b", 0, prompts[1][:-1])])
    decodings = [Decoding("a", prompts[0], refs[0][:8], len(prompts[0]) - 1),
                 Decoding("b", prompts[1], refs[1][:8], len(prompts[1]) - 1)]
    verify_steps(engine, decodings, random.Random(3))  # some history, with rollbacks behind it
    a, b = decodings
    la, lb = a.cached, b.cached

    def ok(d: Decoding, drafts=()):
        return VerifyItem(SequenceInput(d.seq_id, d.cached, d.history[d.cached :]), list(drafts))

    refused = [
        # unknown sequence, next to a valid one
        (UnknownSequence, "ghost", lambda: verify(engine, [ok(a), VerifyItem(SequenceInput("ghost", 0, [5]))])),
        (UnknownSequence, "ghost", lambda: verify(engine, [ok(a), VerifyItem(SequenceInput("ghost", 3, [5]))])),
        (UnknownSequence, "ghost", lambda: engine.length("ghost")),
        # token ids outside the vocabulary, in fed tokens or in drafts, on every entry point
        (InvalidRequest, "outside", lambda: verify(engine, [ok(a), VerifyItem(SequenceInput("b", lb, [VOCAB]))])),
        (InvalidRequest, "outside", lambda: verify(engine, [ok(b, [-1])])),
        (InvalidRequest, "outside", lambda: verify(engine, [ok(a, [5, VOCAB + 100])])),
        (InvalidRequest, "outside", lambda: engine.prefill([SequenceInput("c", 0, [1, 2, VOCAB])])),
        (InvalidRequest, "outside", lambda: propose(engine, [ProposeItem(SequenceInput("c", 0, [1, -5]), 2)])),
        # one sequence twice in one call
        (InvalidRequest, "twice", lambda: verify(engine, [ok(a), ok(a)])),
        (InvalidRequest, "twice", lambda: engine.prefill([SequenceInput("c", 0, [1]), SequenceInput("c", 0, [1])])),
        (InvalidRequest, "twice", lambda: propose(engine, [ProposeItem(SequenceInput("b", lb, [b.history[-1]]), 1),
                                                           ProposeItem(SequenceInput("b", lb, [b.history[-1]]), 1)])),
        # past the context (64 here): prompt, drafts, or the draft's k
        (InvalidRequest, "context", lambda: engine.prefill([SequenceInput("c", 0, [1] * 65)])),
        (InvalidRequest, "context", lambda: verify(engine, [ok(b), VerifyItem(SequenceInput("a", la, [5] * (64 - la)), [5])])),
        (InvalidRequest, "at most 16", lambda: verify(engine, [ok(b), ok(a, [5] * 17)])),
        (InvalidRequest, "at most 8", lambda: verify(engine, [VerifyItem(ok(a).seq, [5, 6], leaves=[list(range(7, 16))])])),
        (InvalidRequest, "context", lambda: propose(engine, [ProposeItem(SequenceInput("c", 0, [1] * 60), 6)])),
        # stale keep_len, empty calls and inputs, bad sampling
        (StaleCache, "keep_len", lambda: verify(engine, [ok(a), VerifyItem(SequenceInput("b", lb + 1, [5]))])),
        (InvalidRequest, "no new tokens", lambda: verify(engine, [VerifyItem(SequenceInput("a", la, []))])),
        (InvalidRequest, "at least one", lambda: engine.prefill([])),
        (InvalidRequest, "empty", lambda: engine.prefill([SequenceInput("", 0, [1])])),
        (InvalidRequest, "temperature", lambda: verify(engine, [VerifyItem(ok(a).seq, [], SamplingParams(-1.0))])),
        (InvalidRequest, "sampled", lambda: verify(engine, [VerifyItem(ok(a).seq, [5], SamplingParams(0.8))])),
    ]
    before = snapshot(engine)
    assert set(before) == {"a", "b"} and before["a"][0] == la and before["b"][0] == lb
    for error, words, call in refused:
        with pytest.raises(error, match=words):
            call()
        assert_unchanged(engine, before)

    # Exactly at the context limit is allowed (the check is not off by one).
    assert engine.prefill([SequenceInput("c", 0, [1] * 64)]) == [64]
    assert engine.release(["c"]) == 1

    # Both sequences continue exactly as if nothing had been refused.
    a.reference, b.reference = refs
    verify_steps(engine, decodings, random.Random(4))
    assert a.generated == refs[0] and b.generated == refs[1]


def test_capacity_is_enforced_and_refusals_change_nothing(target_model):
    engine = Engine(target_model, max_sequences=2)
    prompts = random_prompts([6, 10, 8], seed=10)
    refs = [greedy_reference(target_model, p, 12) for p in prompts]
    engine.prefill([SequenceInput("a", 0, prompts[0][:-1]), SequenceInput("b", 0, prompts[1][:-1])])
    before = snapshot(engine)
    a_item = VerifyItem(SequenceInput("a", 5, [prompts[0][-1]]), refs[0][:2])
    for call in (
        lambda: engine.prefill([SequenceInput("c", 0, prompts[2])]),
        lambda: verify(engine, [a_item, VerifyItem(SequenceInput("c", 0, prompts[2]))], create=True),
        lambda: propose(engine, [ProposeItem(SequenceInput("c", 0, prompts[2]), 2)]),
    ):
        with pytest.raises(CapacityExceeded, match="limit is 2"):
            call()
        assert_unchanged(engine, before)
    # Existing sequences can still be served when the engine is full.
    verdict, = verify(engine, [a_item], create=True)
    assert (verdict.accepted, verdict.next_token) == (2, refs[0][2])
    # Releasing one makes room for exactly one more.
    assert engine.release(["b"]) == 1
    verdict, = verify(engine, [VerifyItem(SequenceInput("c", 0, prompts[2]), refs[2][:3])], create=True)
    assert (verdict.accepted, verdict.next_token) == (3, refs[2][3])
    with pytest.raises(CapacityExceeded):
        engine.prefill([SequenceInput("b", 0, prompts[1])])
    assert set(engine.sequences) == {"a", "c"}


# ---- release -------------------------------------------------------------------------------------


def test_release_is_idempotent_and_frees(target_model):
    engine = Engine(target_model, max_sequences=2)
    prompts = random_prompts([7, 4], seed=11)
    refs = [greedy_reference(target_model, p, 6) for p in prompts]
    engine.prefill([SequenceInput("a", 0, prompts[0]), SequenceInput("b", 0, prompts[1])])
    assert engine.cached_tokens() == 11
    assert engine.release(["a"]) == 1
    assert engine.release(["a"]) == 0
    assert engine.release(["ghost", "a"]) == 0
    assert engine.release([]) == 0
    assert set(engine.sequences) == {"b"}
    assert engine.cached_tokens() == 4
    with pytest.raises(UnknownSequence):
        engine.length("a")
    with pytest.raises(UnknownSequence):
        engine.rollback("a", 0)
    with pytest.raises(UnknownSequence):
        verify(engine, [VerifyItem(SequenceInput("a", 0, prompts[0]))])
    with pytest.raises(UnknownSequence):  # released state is gone: it cannot be kept
        verify(engine, [VerifyItem(SequenceInput("a", 7, [5]))], create=True)
    # The freed slot takes a new sequence; a released id can be rebuilt from scratch.
    engine.prefill([SequenceInput("c", 0, prompts[0][:3])])
    assert engine.release(["b", "c", "b"]) == 2
    assert not engine.sequences and engine.cached_tokens() == 0
    verdict, = verify(engine, [VerifyItem(SequenceInput("a", 0, prompts[0]), refs[0][:4])], create=True)
    assert (verdict.accepted, verdict.next_token, verdict.cached_len) == (4, refs[0][4], len(prompts[0]) + 4)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_idle_sequences_are_reclaimed_and_every_call_renews_the_lease(target_model, draft_model):
    clock = FakeClock()
    engine = Engine(target_model, max_sequences=3, clock=clock)
    prompts = random_prompts([7, 4, 5], seed=12)
    engine.prefill([SequenceInput("a", 0, prompts[0]), SequenceInput("b", 0, prompts[1])])
    clock.now += 50
    engine.prefill([SequenceInput("c", 0, prompts[2])])
    clock.now += 50  # a and b: 100 s untouched, c: 50 s
    verify(engine, [VerifyItem(SequenceInput("a", 6, [prompts[0][-1]]))])  # a verify renews a
    clock.now += 20
    engine.rollback("b", 3)  # a rollback renews b
    clock.now += 20  # untouched for: a 40 s, b 20 s, c 90 s
    assert engine.reclaim_idle(90.0) == []  # not over the lease yet
    assert engine.reclaim_idle(89.0) == ["c"]
    assert set(engine.sequences) == {"a", "b"} and sorted(c.slot for c in engine.sequences.values()) == [0, 1]
    with pytest.raises(UnknownSequence):  # what the coordinator rebuilds from its history
        verify(engine, [VerifyItem(SequenceInput("c", 5, [prompts[2][-1]]))])
    # A reclaimed sequence's slot serves a new one; the survivors' caches are intact.
    engine.prefill([SequenceInput("d", 0, prompts[2])])
    ref = greedy_reference(target_model, prompts[0], 4)
    verdict, = verify(engine, [VerifyItem(SequenceInput("a", 7, [ref[0]]), ref[1:3])])
    assert (verdict.accepted, verdict.next_token) == (2, ref[3])
    clock.now += 1000
    assert sorted(engine.reclaim_idle(60.0)) == ["a", "b", "d"] and not engine.sequences
    # A draft's Propose renews its sequences too.
    draft = Engine(draft_model, clock=clock)
    propose(draft, [ProposeItem(SequenceInput("p", 0, prompts[0]), 3)])
    clock.now += 30
    propose(draft, [ProposeItem(SequenceInput("p", 7, [5]), 2)])
    clock.now += 30
    assert draft.reclaim_idle(45.0) == [] and draft.reclaim_idle(29.0) == ["p"]


# ---- the KV pool: views, gathers and compaction --------------------------------------------------


def test_call_over_non_adjacent_slots_gathers_and_writes_back(target_model):
    """A call whose sequences do not hold neighbouring slots works on a gathered copy and writes
    the kept keys/values back; the sequence between them is untouched."""
    engine = Engine(target_model)
    prompts = random_prompts([6, 9, 13], seed=31)
    refs = [greedy_reference(target_model, p, 12) for p in prompts]
    engine.prefill([SequenceInput(n, 0, p[:-1]) for n, p in zip("abc", prompts)])
    assert [engine.sequences[n].slot for n in "abc"] == [0, 1, 2]
    middle = snapshot(engine)["b"]
    batch = engine.start([SequenceInput("c", len(prompts[2]) - 1, [prompts[2][-1]]),
                          SequenceInput("a", len(prompts[0]) - 1, [prompts[0][-1]])])
    assert batch.gathered
    verdicts = verify(engine, [VerifyItem(SequenceInput("c", len(prompts[2]) - 1, [prompts[2][-1]]), refs[2][:4]),
                               VerifyItem(SequenceInput("a", len(prompts[0]) - 1, [prompts[0][-1]]), refs[0][:2])])
    assert [(v.accepted, v.next_token) for v in verdicts] == [(4, refs[2][4]), (2, refs[0][2])]
    length, kv = middle
    assert engine.length("b") == length and torch.equal(engine.sequences["b"].kv[:, :, :, :length], kv)
    # The written-back keys/values are right: continuing from them still follows the reference.
    verdict, = verify(engine, [VerifyItem(SequenceInput("a", len(prompts[0]) + 2, [refs[0][2]]), refs[0][3:8])])
    assert (verdict.accepted, verdict.next_token) == (5, refs[0][8])


def test_release_keeps_slots_dense_and_moves_data_intact(target_model):
    engine = Engine(target_model)
    prompts = random_prompts([5, 8, 11, 14], seed=32)
    refs = [greedy_reference(target_model, p, 8) for p in prompts]
    engine.prefill([SequenceInput(f"s{i}", 0, p[:-1]) for i, p in enumerate(prompts)])
    before = snapshot(engine)
    engine.release(["s0", "s2"])
    assert sorted(c.slot for c in engine.sequences.values()) == [0, 1]
    for name in ("s1", "s3"):
        length, kv = before[name]
        assert torch.equal(engine.sequences[name].kv[:, :, :, :length], kv)
    # Both survivors are one contiguous view again, and decode exactly.
    items = [VerifyItem(SequenceInput(f"s{i}", len(prompts[i]) - 1, [prompts[i][-1]]), refs[i][:3]) for i in (3, 1)]
    assert not engine.start([item.seq for item in items]).gathered
    verdicts = verify(engine, items)
    assert [(v.accepted, v.next_token) for v in verdicts] == [(3, refs[3][3]), (3, refs[1][3])]


def test_kv_budget_is_enforced(target_model):
    engine = Engine(target_model, max_cache_bytes=64 * 1024)
    with pytest.raises(CapacityExceeded, match="budget"):
        engine.prefill([SequenceInput("big", 0, list(range(5, 95)) * 2)])
    assert not engine.sequences  # nothing is left behind by the refused call
    engine.prefill([SequenceInput("small", 0, [5, 6, 7])])
    assert engine.length("small") == 3


@pytest.mark.parametrize("threads", [1, 2])
def test_fp32_linears_give_each_row_what_it_gets_alone(threads):
    """fp32 speculation is exact only if a row's result does not depend on how many rows share the
    multiply, which MKL's F.linear does not keep (one row takes another kernel). A float32
    PackedLinear runs on oneDNN-reordered weights only for shapes where oneDNN's kernels keep it
    on this CPU and thread count (checked per shape: a small weight may keep it where a large one
    does not): bitwise the same row by row there, and always the same product as F.linear."""
    from specbatch.engine.exactness import differing_by_row_count
    from specbatch.kernels.linear import PackedLinear, onednn_fp32_rows_agree

    generator = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the services run 1 thread each on 2 cores, more on bigger hosts
    try:
        for out_features, in_features in [(96, 64), (576, 1536)]:
            weight = torch.randn(out_features, in_features, generator=generator) * 0.05
            linear = PackedLinear(weight)
            assert linear.prepacked == (torch.backends.mkldnn.is_available()
                                        and onednn_fp32_rows_agree(out_features, in_features))
            x = torch.randn(32, in_features, generator=generator)
            torch.testing.assert_close(linear(x.view(4, 8, -1)), torch.nn.functional.linear(x.view(4, 8, -1), weight),
                                       rtol=1e-5, atol=1e-5)
            if linear.prepacked:
                differing = differing_by_row_count(linear, x, [2, 3, 5, 8, 17, 32])
                assert not any(differing.values()), ((out_features, in_features), differing)
    finally:
        torch.set_num_threads(before)


def test_q8_0_linears_approximate_the_product_and_are_refused_where_unsupported(target_model):
    """Q8_0 blocks (the embedded draft's form on a CPU) give the float32 product within 8-bit error;
    an engine asked for them where they cannot run (bf16, transformers' forward) refuses at start."""
    import copy

    from specbatch.kernels import build
    from specbatch.kernels.linear import linear

    if not build.blocks_available():
        pytest.skip("the GGUF block kernels did not build here")
    generator = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator)
    x = torch.randn(3, 5, 64, generator=generator)
    exact = torch.nn.functional.linear(x, weight, bias)
    approx = linear(weight, bias, "q8_0")(x)
    assert approx.shape == exact.shape
    assert 0 < (approx - exact).norm() / exact.norm() < 0.02
    engine = Engine(target_model, weights="q8_0")
    assert engine.forward.layers[0].qkv.q8_0 and engine.forward.decoder_layers is not None
    with pytest.raises(ValueError, match="Q8_0"):
        Engine(target_model, weights="q8_0", implementation="transformers")
    with pytest.raises(ValueError, match="Q8_0"):
        Engine(copy.deepcopy(target_model).to(torch.bfloat16), weights="q8_0")


@pytest.mark.parametrize("rows, widest", [(1, 1), (1, 6), (4, 7), (32, 40), (3, 600)])
def test_a_calls_layout_is_the_same_built_from_lists_or_from_tensors(monkeypatch, rows, widest):
    """Small calls build their index tensors from Python lists (cheaper), large ones with tensor
    operations: either way the same valid slots, columns and right-aligned tokens."""
    generator = random.Random(rows * 1000 + widest)
    fed = [generator.randint(1, widest) for _ in range(rows)]
    kept = [generator.randint(0, 50) for _ in range(rows)]
    tokens = [[generator.randint(1, VOCAB - 1) for _ in range(n)] for n in fed]
    width = max(fed)
    built = {}
    for slots in (0, 10**9):  # every call through tensor operations, then every call through lists
        monkeypatch.setattr(batch_module, "LIST_BUILT_SLOTS", slots)
        built[slots] = right_aligned(kept, fed, width, tokens)
    for a, b in zip(built[0], built[10**9]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    valid, columns, ids = built[0]
    for r in range(rows):
        pad = width - fed[r]
        assert not valid[r, :pad].any() and valid[r, pad:].all()
        assert columns[r, pad:].tolist() == list(range(kept[r], kept[r] + fed[r]))
        assert ids[r, pad:].tolist() == tokens[r] and not ids[r, :pad].any()


def test_the_host_columns_and_mask_are_what_the_rule_says():
    """``write_columns_and_mask`` on the host (numpy): a real token writes at its position and sees
    its row's columns up to it; a padding token writes to the scratch column and sees column 0."""
    import random

    from specbatch.engine.kv_pool import write_columns_and_mask

    rng = random.Random(3)
    for _ in range(20):
        batch, width = rng.randint(1, 4), rng.randint(1, 6)
        valid = torch.tensor([[rng.random() < 0.7 for _ in range(width)] for _ in range(batch)])
        valid[:, -1] = True
        positions = torch.tensor([[rng.randint(0, 30) for _ in range(width)] for _ in range(batch)])
        end, scratch = int(positions[valid].max()) + 1, 99
        columns, mask = write_columns_and_mask(positions, valid, scratch, end)
        assert columns.dtype == positions.dtype and mask.dtype == torch.bool and mask.shape == (batch, 1, width, end)
        for b in range(batch):
            for t in range(width):
                real, p = bool(valid[b, t]), int(positions[b, t])
                assert int(columns[b, t]) == (p if real else scratch)
                assert mask[b, 0, t].tolist() == [(c <= p) if real else (c == 0) for c in range(end)]
