"""The k policies (coordinator/policy.py) on synthetic profiles: what each chooses and why."""

from __future__ import annotations

import pytest
from test_profile import gpu_like, synthetic_profile

from coordinator.choose import parse_policy
from coordinator.policy import FixedK, Goodput, LiveAcceptance, ProfileK
from coordinator.step_times import LiveStepTimes, StepTimes
from coordinator.profile_file import ProfileFile
from specbatch.protocol.profile import expected_tokens
from specbatch.protocol.speculation import tally_positions

HIGH = [0.9, 0.85, 0.8, 0.75, 0.7, 0.65]
LOW = [0.1, 0.1, 0.1, 0.1, 0.1, 0.1]


def watched(tmp_path, profile) -> ProfileFile:
    path = tmp_path / "profile.json"
    profile.save(path)
    return ProfileFile(path)


def test_tally_positions():
    # (drafted, accepted): 3 drafted, all kept; 3 drafted, first kept; 2 drafted, none kept
    reached, accepted = tally_positions([(3, 3), (3, 1), (2, 0)], 4)
    assert reached == [3, 2, 1, 0]
    assert accepted == [2, 1, 1, 0]


def test_fixed_and_parse():
    assert parse_policy("fixed:2", 16).k_for(32) == 2
    assert parse_policy("fixed:0", 16).describe() == "fixed:0"
    with pytest.raises(ValueError, match="needs a profile"):
        parse_policy("goodput", 16)
    with pytest.raises(ValueError, match="needs a profile"):
        parse_policy("profile", 16)
    with pytest.raises(ValueError, match="unknown k policy"):
        parse_policy("adaptive", 16)
    with pytest.raises(ValueError, match=r"k must be in \[0, 16\]"):
        parse_policy("fixed:17", 16)


def test_profile_policy_follows_best_k_and_interpolates(tmp_path):
    profile = synthetic_profile(gpu_like, HIGH)
    policy = parse_policy("profile", 16, watched(tmp_path, profile))
    assert isinstance(policy, ProfileK) and policy.describe() == "profile"
    for b in profile.batch_sizes:
        assert policy.k_for(b) == profile.best_k[b]
    assert policy.k_for(64) == profile.best_k[32]
    b0, b1 = 8, 16
    for b in range(b0, b1 + 1):
        assert min(profile.best_k[b0], profile.best_k[b1]) <= policy.k_for(b) <= max(profile.best_k[b0], profile.best_k[b1])


def test_goodput_drafts_long_at_batch_one_when_acceptance_is_high(tmp_path):
    policy = Goodput(watched(tmp_path, synthetic_profile(gpu_like, HIGH)), 16)
    assert policy.k_for(1) >= 4
    ks = [policy.k_for(b) for b in (1, 2, 4, 8, 16, 32)]
    assert ks == sorted(ks, reverse=True) and ks[-1] <= 1


def test_goodput_does_not_draft_when_acceptance_is_low(tmp_path):
    policy = Goodput(watched(tmp_path, synthetic_profile(gpu_like, LOW)), 16)
    assert [policy.k_for(b) for b in (1, 4, 32)] == [0, 0, 0]


def test_goodput_does_not_draft_when_step_cost_grows_fast(tmp_path):
    """Acceptance is high, but each drafted token costs as much as a whole step (CPU-like)."""
    policy = Goodput(watched(tmp_path, synthetic_profile(lambda b, k: 10.0 * (k + 1) * b, HIGH)), 16)
    assert [policy.k_for(b) for b in (1, 2, 8, 32)] == [0, 0, 0, 0]


def test_goodput_agrees_with_the_profile_on_profiled_sizes_before_it_learns(tmp_path):
    """With the profile's own acceptance, goodput drafts the table's fastest k (best_k may be a
    smaller k within NEAR_BEST of it)."""
    profile = synthetic_profile(gpu_like, HIGH)
    policy = Goodput(watched(tmp_path, profile), 16)
    for b in profile.batch_sizes:
        row = [profile.cells[b, k].ms_per_token for k in range(profile.max_k + 1)]
        assert policy.k_for(b) == row.index(min(row))
        assert profile.best_k[b] <= policy.k_for(b)


def test_goodput_learns_live_acceptance_and_probes_while_idle(tmp_path):
    policy = Goodput(watched(tmp_path, synthetic_profile(gpu_like, HIGH)), 16, half_life=8, probe_every=10)
    chosen = policy.k_for(1)
    assert chosen >= 4
    # Live traffic on which the draft is rarely right: every draft rejected at position 0.
    for _ in range(40):
        k = policy.k_for(1)
        policy.observe([(k, 0)] if k else [])
    assert policy.acceptance_by_position()[0] < 0.2
    # Idle at k = 0: one probe every 10 steps, drafting what the profile alone would choose.
    ks = []
    for _ in range(30):
        ks.append(policy.k_for(1))
        policy.observe([(ks[-1], 0)] if ks[-1] else [])
    assert ks.count(0) >= 27 and set(ks) - {0} == {chosen}
    # The draft has become good again: probes see it, and drafting resumes.
    for _ in range(100):
        k = policy.k_for(1)
        policy.observe([(k, k)] if k else [])
    assert policy.acceptance_by_position()[0] > 0.8
    assert policy.k_for(1) >= chosen  # every draft accepted lately: at least as long as before
    # At batch 32 the profile itself says drafting does not pay there: no probes, ever.
    idle = Goodput(watched(tmp_path, synthetic_profile(lambda b, k: 10.0 * (k + 1) * b, HIGH)), 16, probe_every=2)
    for _ in range(10):
        assert idle.k_for(32) == 0
        idle.observe([])


def test_goodput_takes_up_a_reloaded_profile(tmp_path):
    profile_file = watched(tmp_path, synthetic_profile(gpu_like, HIGH))
    policy = Goodput(profile_file, 16)
    assert policy.k_for(1) >= 4
    synthetic_profile(gpu_like, LOW).save(profile_file.path)
    import os
    import time

    os.utime(profile_file.path, ns=(time.time_ns(), time.time_ns()))
    assert profile_file.check()
    assert policy.k_for(1) == 0
    assert policy.acceptance_by_position() == pytest.approx(LOW)  # restarted from the new profile


def test_live_acceptance_is_a_moving_average_over_drafts():
    live = LiveAcceptance([0.5, 0.5], half_life=1.0)
    live.observe([])
    assert live.rates == [0.5, 0.5]  # nothing drafted: nothing learnt
    live.observe([(2, 2)])  # one draft, both positions accepted: half the weight moves
    assert live.rates == pytest.approx([0.75, 0.75])
    live.observe([(2, 0)] * 2)  # two drafts rejected at 0: a quarter of the weight stays
    assert live.rates == pytest.approx([0.75 / 4, 0.75])


def test_fixed_ignores_observations():
    policy = FixedK(3)
    policy.observe([(3, 0)] * 100)
    assert policy.k_for(1) == 3


# ---- leaves: how many of the draft's next-best tokens to verify beside the first draft ------------

MEDIUM = [0.5, 0.45, 0.45, 0.4, 0.4, 0.4]


def test_leaf_ranks_need_no_starting_value():
    from coordinator.policy import LeafRanks

    ranks = LeafRanks(3, half_life=8)
    assert ranks.hit_rate(3) == 0.0  # nothing seen: no leaf is worth a row yet
    ranks.observe([0, None, 1, 0])
    assert ranks.hit_rate(1) > ranks.hit_rate(0) == 0.0
    assert ranks.hit_rate(2) > ranks.hit_rate(1) and ranks.hit_rate(3) == ranks.hit_rate(2)
    assert 0.7 < ranks.hit_rate(3) < 0.8  # 3 of 4, weighted to the later ones


def test_goodput_verifies_leaves_where_rows_are_cheap_and_they_hit(tmp_path):
    """Verifying a row costs 1 % of a step (a GPU at batch 1, or bf16 on AVX512_BF16)."""
    policy = Goodput(watched(tmp_path, synthetic_profile(lambda b, k: 20.0 + 0.2 * k * b, MEDIUM)), 16, max_leaves=3)
    assert policy.leaves_for(1, policy.k_for(1), 3) == 0  # no hit seen yet
    policy.observe_first_rejections([0, 1, 0, None, 2, 0, 1, 0] * 8)
    k = policy.k_for(1)
    assert k >= 1 and policy.leaves_for(1, k, 3) == 3
    assert policy.leaves_for(1, k, 2) == 2  # never more than the draft proposed
    assert policy.leaves_for(1, 0, 3) == 0
    assert policy.leaves_for(1, 16, 3) == 0  # a request's own k past the profile's max_k (6): no leaves, no error


def test_goodput_skips_leaves_that_cost_more_than_they_yield(tmp_path):
    """Each row costs as much as the step's fixed part (CPU-like in fp32), and leaves hit seldom."""
    policy = Goodput(watched(tmp_path, synthetic_profile(lambda b, k: 10.0 + 6.0 * k * b, MEDIUM)), 16,
                     max_leaves=3)
    policy.observe_first_rejections([None, None, None, 0, None, None, None, None] * 8)
    assert all(policy.leaves_for(b, policy.k_for(b), 3) == 0 for b in (1, 4, 32))
    assert policy.leaves_for(1, 1, 3) == 0  # a request held to k = 1 as well


def test_fixed_and_profile_policies_verify_every_leaf(tmp_path):
    assert FixedK(2).leaves_for(4, 2, 3) == 3
    assert ProfileK(watched(tmp_path, synthetic_profile(gpu_like, HIGH))).leaves_for(4, 2, 1) == 1


# ---- live step times ---------------------------------------------------------------------------


def served(k: int) -> StepTimes:
    """A batch-4 step as served, where the profile below overprices each verified row 6×: the
    Propose 0.2 ms a draft (as profiled), the Verify 9.9 + 0.8 ms a draft, 0.1 ms besides."""
    return StepTimes(4, 4 if k else 0, k, k, 0.2 * k, 9.9 + 0.8 * k, 10.0 + 1.0 * k)


def overpriced():
    """Profiled: a step of k drafts at 10 + 6k ms (Propose 0.2k, Verify 9.9 + 5.8k, 0.1 besides)."""
    return synthetic_profile(lambda b, k: 10.0 + 6.0 * k, HIGH, sizes=(1, 2, 4, 8))


def test_live_step_times_price_unmeasured_ks_from_the_measured_slope():
    profile = overpriced()
    times = LiveStepTimes(profile, window=16, trusted=4)
    assert times.step_ms(4, 3) == pytest.approx(profile.step_ms(4, 3))  # nothing measured: the profile's
    for _ in range(3):
        times.observe(served(2))
    assert times.step_ms(4, 2) == pytest.approx(profile.step_ms(4, 2))  # three steps are not trusted yet
    times.observe(served(2))
    # One k trusted: its ratio for every k at that size (the verify row's price is not known yet).
    assert times.target_ms(4, 2) == pytest.approx(11.5)
    assert times.target_ms(4, 3) == pytest.approx(profile.target_ms(4, 3) * 11.5 / profile.target_ms(4, 2))
    for _ in range(4):
        times.observe(served(1))
    # Two: the measured slope prices the next k, at batch 3 too (the nearest profiled size is 4);
    # further ks keep the profile's shape at the nearest one's ratio.
    assert times.step_ms(4, 3) == pytest.approx(13.0) and times.step_ms(3, 3) == pytest.approx(13.0)
    ratio = 11.5 / profile.target_ms(4, 2)
    assert times.target_ms(4, 5) == pytest.approx(11.5 + ratio * (profile.target_ms(4, 5) - profile.target_ms(4, 2)))
    assert times.step_ms(1, 3) == pytest.approx(profile.step_ms(1, 3))  # another size: still the profile's
    # A stray step (a prefill beside it) moves a median of a window not at all.
    times.observe(StepTimes(4, 4, 2, 2, 0.4, 40.0, 41.0))
    assert times.target_ms(4, 2) == pytest.approx(11.5)
    assert times.measured(4, 2) == 5 and times.measured(4, 3) == 0


def test_live_step_times_keep_what_asking_the_draft_costs_outside_the_calls_apart():
    """A step that asks the draft spends more outside both calls than a k = 0 step (one more
    call): each kind is priced by its own window, so the k served does not set the other's."""
    times = LiveStepTimes(overpriced(), window=16, trusted=4)
    for _ in range(4):
        times.observe(StepTimes(4, 0, 0, 0, 0.0, 9.9, 10.9))  # k = 0: 1 ms besides
        times.observe(StepTimes(4, 4, 2, 2, 0.4, 11.5, 14.9))  # k = 2: 3 ms besides
    assert times.step_ms(4, 0) == pytest.approx(10.9)
    assert times.step_ms(4, 2) == pytest.approx(14.9)


def test_goodput_live_drafts_more_once_served_steps_prove_cheaper_than_profiled(tmp_path):
    """The profile prices a verified row 6× what it costs served: goodput picks k = 2 from it, and
    with live step times, serving steps at what they cost (its probes of a neighbouring k
    measuring the slope), it moves to the k that is best at the served costs. Plain ``goodput``
    stays where the profile put it."""
    live = Goodput(watched(tmp_path, overpriced()), max_k=6, probe_every=4, live_times=True)
    static = parse_policy("goodput", 6, watched(tmp_path, overpriced()))
    assert parse_policy("goodput:live", 6, watched(tmp_path, overpriced())).describe() == "goodput:live"
    assert static.describe() == "goodput" and live.describe() == "goodput:live"
    assert live.k_for(4) == static.k_for(4) == 2
    for _ in range(600):
        k = live.k_for(4)
        live.observe_times(served(k))
        static.observe_times(served(static.k_for(4)))
    rates = live.acceptance_by_position()
    best_served = max(range(7), key=lambda k: expected_tokens(rates, k) / (10.0 + 1.0 * k))
    assert best_served >= 4
    assert live._best(4, rates)[0] == best_served
    assert static.k_for(4) == 2


def test_goodput_live_prices_its_choices_every_few_steps_and_plain_goodput_every_step(tmp_path, monkeypatch):
    """Pricing every (k, leaves) was most of a step's work in the coordinator: goodput:live reprices
    once every ``reprice_every`` served steps (and when the batch size is new to it), plain goodput,
    whose prices move only with acceptance, at every step."""
    live = Goodput(watched(tmp_path, synthetic_profile(gpu_like, HIGH)), max_k=6, live_times=True)
    static = Goodput(watched(tmp_path, synthetic_profile(gpu_like, HIGH)), max_k=6)
    priced = {id(live): 0, id(static): 0}
    for policy in (live, static):
        best = policy._best

        def counted(batch_size, acceptance, policy=policy, best=best):
            priced[id(policy)] += 1
            return best(batch_size, acceptance)

        monkeypatch.setattr(policy, "_best", counted)
    for step in range(12):
        for policy in (live, static):
            k = policy.k_for(2)
            policy.observe([(k, 1)] * 2)
            policy.observe_times(StepTimes(2, 2, k, k, 1.0 * k, 10.0 + k, 12.0 + 2 * k))
    assert priced[id(live)] == 12 // live.reprice_every and priced[id(static)] == 12
    live.k_for(4)  # a batch size it has not priced
    assert priced[id(live)] == 12 // live.reprice_every + 1


def test_goodput_live_probes_only_neighbours_priced_near_the_best(tmp_path):
    """At batch 32 on gpu_like times, k = 1 costs 1.7x a k = 0 step. Where drafts are seldom
    accepted it yields 0.65 of k = 0's tokens per ms, and a probe of it costs more than it could
    teach: goodput:live never runs it. Where acceptance brings it within probe_within of k = 0,
    it is probed back to back (half of each probe_every steps) until trusted, then one step in
    probe_every runs it."""
    def ks_run(acceptance) -> list[int]:
        live = Goodput(watched(tmp_path, synthetic_profile(gpu_like, acceptance)), max_k=6, probe_every=4,
                       live_times=True)
        ks = []
        for _ in range(64):
            ks.append(k := live.k_for(32))
            live.observe([(k, 1)] * 18 + [(k, 0)] * 14 if k else [])  # 0.56 accepted at the first position
            live.observe_times(StepTimes(32, 32 if k else 0, k, k, 0.2 * k, gpu_like(32, k) - 0.2 * k - 0.1,
                                         gpu_like(32, k)))
        return ks

    assert set(ks_run(LOW)) == {0}
    near = [0.55] * 6  # k = 1: 1.55 tokens in 48.9 ms against 1 in 29.2: 0.93 of k = 0
    ks = ks_run(near)
    assert ks[:8] == [0, 0, 1, 1, 0, 0, 1, 1]  # 4 probes: trusted
    assert ks.count(1) == 4 + (64 - 8) // 4


def test_goodput_live_stops_drafting_within_a_few_windows_where_a_served_row_costs_more_than_profiled(tmp_path):
    """The profile was measured where a verified row cost 0.5 ms on a 10 ms step (weights read from
    memory); served, the step is 5 ms and a row 3 ms (weights in cache). At 0.5 acceptance the
    profile prices k = 1 best and k = 0 at 0.70 of it; served, k = 0 is best. goodput:live
    probes k = 0 back to back (it is kept measured whatever its price) and serves it from
    within the second window on; plain goodput drafts on."""
    rates = [0.5] * 6
    profile = synthetic_profile(lambda b, k: 10.0 + 0.5 * k, rates, sizes=(1, 2, 4))
    live = Goodput(watched(tmp_path, profile), max_k=6, probe_every=16, live_times=True)
    static = Goodput(watched(tmp_path, profile), max_k=6, probe_every=16)
    assert live.k_for(1) == static.k_for(1) >= 1
    ks = []
    for _ in range(128):
        ks.append(k := live.k_for(1))
        live.observe([(k, 1)] if k else [])  # (a run at 1.0: the rates stay near 0.5)
        live.observe([(k, 0)] if k else [])
        live.observe_times(StepTimes(1, 1 if k else 0, k, k, 0.2 * k, 4.9 + 2.8 * k, 5.0 + 3.0 * k))
        static.observe_times(StepTimes(1, 1, 1, 1, 0.2, 7.7, 8.0))
    assert 0 in ks[:16]  # the first window's probes
    assert ks[32:].count(0) >= 0.9 * len(ks[32:])
    assert static.k_for(1) >= 1


def test_goodput_live_follows_the_machine_from_one_spell_to_the_next(tmp_path):
    """The machine's speed moves between spells: for 400 steps a verified row costs 0.5 ms on a
    10 ms step (drafting pays), then 3 ms on a 5 ms step (it does not). The k served reprices at
    once, and k = 0, measured only by probes while drafting, is re-measured once its last
    spell's measurements age out (``horizon``): from a hundred steps after the change it is
    served (kept for the whole window instead, they held k = 1 for 400 steps more)."""
    rates = [0.6] * 6
    profile = synthetic_profile(lambda b, k: 10.0 + 0.5 * k, rates, sizes=(1, 2, 4))
    live = Goodput(watched(tmp_path, profile), max_k=6, live_times=True)

    def step(base: float, row: float) -> int:
        k = live.k_for(1)
        live.observe([(k, 1), (k, 0)] if k else [])  # near 0.5 at the first position
        live.observe_times(StepTimes(1, 1 if k else 0, k, k, 0.2 * k, base - 0.1 + row * k, base + (row + 0.2) * k))
        return k

    slow = [step(10.0, 0.5) for _ in range(400)]
    assert slow[-200:].count(0) <= 0.1 * 200  # drafting pays: k = 0 only as a probe
    fast = [step(5.0, 3.0) for _ in range(300)]
    assert fast[100:].count(0) >= 0.85 * 200

