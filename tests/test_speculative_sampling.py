"""Speculative sampling is exact in distribution, and seeded draws do not depend on the batch.

Runs the draft's proposals and the target's verification in process, on engines over tiny
random models with a 16-token vocabulary, with thousands of sequences batched per call (the
scheduler's loop, without gRPC: tests/test_sampled_serving.py covers the services).

The distribution test, for each emitted position j: under the target's own sampling, token j
given its prefix follows p(. | prefix) (after temperature/top-k/top-p). So the histogram of
token j over all samples has expectation E = sum_s p_s and covariance sum_s (diag p_s - p_s p_s^T),
whatever the prefixes were; the Mahalanobis distance of the observed histogram from E is
chi-squared with (cells - 1) degrees of freedom (cells with expected count < 5 pooled). p_s comes
from a plain forward of the target model (transformers, no engine) on the sampled sequences
and from ``target_distribution``, the reference definition. Position 1's prefix is the prompt
alone, so there it is Pearson's test against the exact distribution. A configuration passes
when every position's p-value is above 0.001 / positions (Bonferroni: each configuration is
one test at significance 0.001). Seeds are fixed, so results are deterministic.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from coordinator.lookup import PromptLookup
from draft_service.proposer import Proposal, ProposeItem, proposals
from specbatch.engine import acceptance
from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.engine.sampling import (
    DRAW_ACCEPT,
    DRAW_DRAFT,
    DRAW_TARGET,
    SamplingParams,
    SparseDistribution,
    distributions,
    params_tensors,
    sample,
    target_distribution,
    uniforms,
)
from specbatch.models.eagle import draft_from_target
from specbatch.models.loading import keep_first_layers
from target_service import verifier
from target_service.verifier import VerifyItem, verify

VOCAB = 16
PROMPT = [1, 5, 9, 3]
ALPHA = 1e-3
PLAIN = dict(temperature=1.0)
CUT = dict(temperature=0.7, top_k=8, top_p=0.85)


def small_llama(seed: int, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random weights give near-uniform p; this gives it shape
        model.lm_head.weight.mul_(16.0)
    return model


@pytest.fixture(scope="module")
def target():
    return small_llama(0, layers=2)


@pytest.fixture(scope="module")
def disjoint_draft(target):
    """The target with its output head negated: q puts its mass where p has little."""
    draft = copy.deepcopy(target)
    with torch.no_grad():
        draft.lm_head.weight.neg_()
    return draft


@pytest.fixture(scope="module")
def partial_draft(target):
    """The target's first layer: q overlaps p in part."""
    draft = copy.deepcopy(target)
    keep_first_layers(draft, 1)
    return draft


@pytest.fixture(scope="module")
def flat_draft(target):
    """The target with a flatter head: q ranks tokens as p does but spreads its mass, so drafts
    are often rejected and the residual's draw is often one of the draft's next-best tokens."""
    draft = copy.deepcopy(target)
    with torch.no_grad():
        draft.lm_head.weight.mul_(0.3)
    return draft


@pytest.fixture(scope="module")
def subset_draft(target):
    """An EAGLE-style draft (reads target features) whose head covers 10 of the 16 tokens: its q
    is zero outside them, and its head columns map to token ids."""
    torch.manual_seed(1)
    return draft_from_target(target, 1, token_subset=torch.tensor([0, 2, 3, 4, 6, 7, 9, 11, 12, 15])).eval()


# ---- the scheduler's loop, in process ------------------------------------------------------------


def speculate(target, draft, groups, length, support_size=32, seed_base=0, leaves=(),
              copied=False) -> tuple[list[list[int]], list[float]]:
    """Sample ``length`` new tokens after PROMPT for every sequence of ``groups`` ([(params without
    seed, k, sequences)]): prefill through the target, then propose/verify steps, as the
    scheduler does, with ``leaves`` (counts per drafted position) asked of the draft. Sequence i
    is seeded ``seed_base + i``. Returns the new tokens and the fraction of drafts accepted (a
    kept leaf counts as accepted), per sequence. ``copied``: drafts are not the draft's but copied
    from each sequence's history, as the coordinator's prompt lookup drafts (coordinator/lookup.py;
    where it finds none, the last token repeated), each from a point mass."""
    specs = [(SamplingParams(seed=seed_base + i, **params), k) for i, (params, k) in
             enumerate((params, k) for params, k, n in groups for _ in range(n))]
    n = len(specs)
    target_engine, draft_engine = Engine(target, max_sequences=n), Engine(draft, max_sequences=n)
    eagle = bool(draft_engine.feature_size)
    ids = [f"s{i}" for i in range(n)]
    verdicts = verify(target_engine, [VerifyItem(SequenceInput(ids[i], 0, PROMPT), [], specs[i][0]) for i in range(n)],
                      create=True, return_features=eagle)
    history = [PROMPT + [v.next_token] for v in verdicts]
    target_len = [v.cached_len for v in verdicts]
    draft_len = [0] * n
    features = [v.features.float() if eagle else None for v in verdicts]  # target feature per cached position
    proposed_count, accepted_count = [0] * n, [0] * n

    def draft_item(i: int) -> ProposeItem:
        start = draft_len[i]
        fed = None
        if eagle:  # the draft reads, with token j, the target's feature at j - 1
            fed = torch.cat([torch.zeros(1, features[i].shape[1]), features[i]])[start : len(history[i])]
        return ProposeItem(SequenceInput(ids[i], start, history[i][start:], fed), k[i], specs[i][0],
                           list(leaves[: k[i]]))

    while True:
        # As the scheduler's k_for: draft no more than the sequence can still use.
        k = {i: min(specs[i][1], length - (len(history[i]) - len(PROMPT)) - 1) for i in range(n)}
        active = [i for i in range(n) if len(history[i]) - len(PROMPT) < length]
        if not active:
            break
        drafting = [i for i in active if k[i] > 0]
        if copied:
            proposed = {i: copied_proposal(history[i], k[i]) for i in drafting}
        else:
            proposed = dict(zip(drafting, proposals(draft_engine, [draft_item(i) for i in drafting], support_size)
                                if drafting else []))
        empty = Proposal([])
        verdicts = verify(target_engine, [
            VerifyItem(SequenceInput(ids[i], target_len[i], history[i][target_len[i]:]), proposed.get(i, empty).tokens,
                       specs[i][0], proposed.get(i, empty).distributions, proposed.get(i, empty).leaves)
            for i in active], return_features=eagle)
        for i, v in zip(active, verdicts):
            tokens, before = proposed.get(i, empty).tokens, len(history[i])
            if eagle:
                features[i] = torch.cat([features[i][: target_len[i]], v.features.float()])
            if tokens and not copied:
                draft_len[i] = min(draft_engine.length(ids[i]), before + v.accepted)
            target_len[i] = v.cached_len
            kept = tokens[: v.accepted] + ([] if v.leaf is None else [v.leaf])
            history[i] += kept + [v.next_token]
            proposed_count[i] += len(tokens)
            accepted_count[i] += len(kept)
    return ([h[len(PROMPT) : len(PROMPT) + length] for h in history],
            [a / max(p, 1) for a, p in zip(accepted_count, proposed_count)])


def copied_proposal(history: list[int], k: int) -> Proposal:
    tokens = PromptLookup().drafts(history, k) or [history[-1]] * k
    return Proposal(tokens, [SparseDistribution(np.array([t]), np.array([1.0], dtype=np.float32)) for t in tokens])


# ---- the test statistic --------------------------------------------------------------------------


def exact_next_token_probs(target, samples: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """p(. | PROMPT + sample[:j]) for every sample and j, [samples, length, V], by a plain forward."""
    inputs = torch.tensor([PROMPT + s[:-1] for s in samples])
    with torch.no_grad():
        logits = target(inputs).logits[:, len(PROMPT) - 1 :]
    return target_distribution(logits, params).double()


def chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Tokens [S] drawn each from its own distribution probs [S, V]: the p-value of the
    Mahalanobis distance between their histogram and its expectation (module docstring)."""
    if (probs.gather(1, tokens[:, None]) <= 0).any():
        return 0.0  # a token its distribution cannot give
    observed = torch.bincount(tokens, minlength=probs.shape[1]).double()
    expected = probs.sum(0)
    covariance = torch.diag(expected) - probs.T @ probs
    big = expected >= 5
    cells = torch.cat([torch.eye(len(expected), dtype=torch.float64)[big], (~big).double()[None]])
    cells = cells[cells @ expected > 0]  # drop an empty pooled cell
    diff = cells @ (observed - expected)
    cov = cells @ covariance @ cells.T
    stat = float(diff @ torch.linalg.pinv(cov, hermitian=True) @ diff)
    dof = len(cells) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def position_pvalues(target, samples: list[list[int]], params: SamplingParams) -> list[float]:
    probs = exact_next_token_probs(target, samples, params)
    tokens = torch.tensor(samples)
    return [chi2_pvalue(tokens[:, j], probs[:, j]) for j in range(tokens.shape[1])]


def check(target, draft, ks, support_size=32, per_group=1000, seed_base=0, leaves=(), copied=False):
    """Samples with and without cuts (mixed in one batch) at each k; returns
    {(cut, k): (p-value per position, mean acceptance)}.
    Each run checks k + 2 positions: the prefill's token, a whole step of k drafts and the bonus
    token, and one more (decided at a different offset within its step)."""
    results = {}
    for k in ks:
        groups = [(PLAIN, k, per_group), (CUT, k, per_group)]
        samples, acceptance = speculate(target, draft, groups, k + 2, support_size, seed_base + 10 * k * per_group,
                                        leaves, copied)
        for g, (params, _, _) in enumerate(groups):
            group = slice(g * per_group, (g + 1) * per_group)
            results[("cut" if params is CUT else "plain", k)] = (
                position_pvalues(target, samples[group], SamplingParams(**params)), float(np.mean(acceptance[group])))
    return results


def passes(pvalues: list[float]) -> bool:
    return min(pvalues) > ALPHA / len(pvalues)


def overlap(target, draft, params) -> float:
    """sum_x min(p, q) at the prompt: the acceptance rate of a first draft."""
    with torch.no_grad():
        p = target_distribution(target(torch.tensor([PROMPT])).logits[0, -1], SamplingParams(**params))
        q_logits = draft(torch.tensor([PROMPT])).logits[0, -1]
    return float(torch.minimum(p, target_distribution(q_logits, SamplingParams(**params))).sum())


# ---- exact in distribution -----------------------------------------------------------------------


@pytest.mark.parametrize("ks", [(1, 2), (4, 8)])
def test_draft_equal_to_target(target, ks):
    """q = p: every draft is accepted (up to float rounding between batch shapes), and the tokens,
    nearly all drawn by the draft, follow p."""
    for config, (pvalues, acceptance) in check(target, target, ks).items():
        assert passes(pvalues), (config, pvalues)
        assert acceptance > 0.999, (config, acceptance)


@pytest.mark.parametrize("ks", [(1, 2), (4, 8)])
def test_nearly_disjoint_draft_with_truncated_q(target, disjoint_draft, ks):
    """q puts its mass where p has little, and the draft samples from its top 5 tokens only:
    almost every draft is rejected and tokens come from the residual, which must make up p."""
    assert overlap(target, disjoint_draft, PLAIN) < 0.15 and overlap(target, disjoint_draft, CUT) < 0.01
    for config, (pvalues, acceptance) in check(target, disjoint_draft, ks, support_size=5, seed_base=1_000_000).items():
        assert passes(pvalues), (config, pvalues)
        assert acceptance < 0.15, (config, acceptance)


def test_eagle_draft_over_a_token_subset(target, subset_draft):
    """q is zero outside the head's 10 tokens (the residual then carries p's other 6), its head
    columns are mapped to token ids, and it reads the target's features."""
    for config, (pvalues, acceptance) in check(target, subset_draft, (4,), seed_base=2_000_000).items():
        assert passes(pvalues), (config, pvalues)
        assert 0.05 < acceptance < 0.95, (config, acceptance)


def test_drafts_copied_from_the_history_keep_tokens_distributed_as_p(target):
    """Prompt lookup's drafts (coordinator/lookup.py) are no draw at all: each is verified as drawn
    from a point mass, kept with probability p(x), and a rejection draws from p without x."""
    for config, (pvalues, acceptance) in check(target, target, (3,), seed_base=5_000_000, copied=True).items():
        assert passes(pvalues), (config, pvalues)
        assert 0.02 < acceptance < 0.9, (config, acceptance)


# ---- negative controls: the same test catches wrong rules ----------------------------------------


def test_always_accepting_fails_the_test(target, disjoint_draft, monkeypatch):
    monkeypatch.setattr(acceptance, "acceptance_probability", lambda p_x, q_x: torch.ones_like(p_x))
    for config, (pvalues, _) in check(target, disjoint_draft, (2,), seed_base=3_000_000).items():
        assert not passes(pvalues), (config, pvalues)
        assert pvalues[0] > ALPHA  # the prefill's token is not drafted: still right
        assert min(pvalues[1:]) < 1e-12


def test_resampling_from_p_after_a_rejection_fails_the_test(target, partial_draft, monkeypatch):
    """A subtler bug: on rejection, draw from p instead of the residual. Tokens then follow
    min(p, q) + (1 - sum min(p, q)) p, off from p by less than the draft's rejection rate."""
    assert 0.6 < overlap(target, partial_draft, PLAIN) < 0.9
    monkeypatch.setattr(acceptance, "residual_distribution", lambda p, q_ids, q_probs: p)
    results = check(target, partial_draft, (2,), seed_base=4_000_000)
    assert not passes(results[("plain", 2)][0]), results


@pytest.mark.parametrize("leaves", [(3,), (2, 1, 1)])
def test_leaves_keep_tokens_distributed_as_p(target, flat_draft, leaves):
    """Leaves beside the chain: where the residual's draw is a leaf, the token after it comes from
    p at that leaf in the same step; every position still follows p."""
    results = check(target, flat_draft, (2,), seed_base=5_000_000, leaves=leaves)
    for config, (pvalues, acceptance) in results.items():
        assert passes(pvalues), (config, pvalues)
    # The leaves were hit: kept drafts and leaves together exceed the chain's rate.
    chain = check(target, flat_draft, (2,), seed_base=5_000_000)
    assert results[("plain", 2)][1] > chain[("plain", 2)][1] + 0.05, (results, chain)


def test_keeping_a_leaf_whatever_the_draw_fails_the_test(target, flat_draft, monkeypatch):
    """The negative control of the leaf rule: keep the first leaf at a rejected position whatever
    token the residual drew there."""
    monkeypatch.setattr(verifier, "leaf_hit", lambda leaves, accepted, drafted, token:
                        0 if accepted < min(drafted, len(leaves)) and leaves[accepted] else None)
    results = check(target, flat_draft, (2,), seed_base=6_000_000, leaves=(3,))
    assert not passes(results[("plain", 2)][0]), results


def test_the_correct_rule_passes_where_the_bugs_fail(target, partial_draft):
    results = check(target, partial_draft, (2,), seed_base=4_000_000)
    for config, (pvalues, _) in results.items():
        assert passes(pvalues), (config, pvalues)


# ---- the batched distributions match the reference definition ------------------------------------


def test_batched_cuts_match_the_reference():
    """Per-row temperature/top-k/top-p without a sort (including a nucleus wider than the first
    search window, and tied logits at both cut points) equals ``target_distribution``."""
    torch.manual_seed(0)
    logits = torch.randn(12, 3000) * 3
    logits[0] = 0.01 * torch.randn(3000)  # flat: the nucleus spans thousands of tokens
    logits[1, :10] = 5.0  # ties at the top-k and top-p boundaries
    params = [SamplingParams(t, p, k) for t, p, k in [(1.0, 0.9, 0), (1.0, 0.5, 4), (0.5, 1.0, 7), (2.0, 0.95, 100),
                                                      (1.3, 0.3, 0), (0.7, 1.0, 0), (1.0, 0.999, 2999),
                                                      (1.0, 1.0, 1), (0.01, 0.5, 0), (1e-30, 1.0, 0),
                                                      (100.0, 0.99, 50), (1.0, 1e-6, 0)]]
    batched = distributions(logits, *params_tensors(params)).probs()
    for row, p in enumerate(params):
        reference = target_distribution(logits[row].double().float(), p) if p.temperature >= 0.01 else None
        if reference is None:  # tiny temperature: the reference overflows; the answer is the argmax
            reference = torch.nn.functional.one_hot(logits[row].argmax(), 3000).float()
        assert torch.allclose(batched[row].float(), reference, atol=1e-6), (row, p)
        assert torch.equal(batched[row] > 0, reference > 0), (row, p)


def test_draws_are_pure_functions_of_seed_position_and_purpose():
    u = uniforms([7, 7, 8], [[5, 6, 7]] * 3, DRAW_TARGET)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(u[0, 1:], uniforms([7], [[6, 7]], DRAW_TARGET)[0])  # no state: any subset, any order
    assert not torch.equal(u[0], uniforms([7], [[5, 6, 7]], DRAW_ACCEPT)[0])
    many = uniforms(list(range(200)), [list(range(500))] * 200, DRAW_DRAFT).view(-1)
    assert 0 <= float(many.min()) and float(many.max()) < 1 and abs(float(many.mean()) - 0.5) < 0.005
    assert len(torch.unique(many)) == len(many)


def test_inverse_cdf_draws_never_pick_a_zero_weight():
    weights = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0]] * 4)
    u = torch.tensor([0.0, 0.3 - 1e-6, 0.3 + 1e-6, 1 - 2**-53], dtype=torch.float64)
    assert sample(weights, u).tolist() == [1, 1, 3, 3]
