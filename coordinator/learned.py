"""The ``learn`` k policy: goodput over a profile the coordinator measures while it serves, for a
pair or a machine no profile was made for.

It starts at k = 0, which is never slower than target-only decoding, and spends a bounded share
of steps (one in ``probe_every``) on a neighbour of the k it serves: the nearest k not yet measured
at this batch size, else, one probe in four, the one measured least among the neighbours priced
near the best and k = 0 (whatever its price: a seeded one is otherwise never served again).
While a neighbour is not yet measured, the probes come ``trusted`` steps back to back
every ``probe_every`` (``_probe_step``), so that it climbs one k per ``probe_every`` steps, not per
``trusted × probe_every``. It serves only ks measured at the batch size at hand (and k = 0). Each
step's parts are kept per (batch size, k), as ``specbatch profile`` measures them, in windows of
the last ``window`` steps; a (size, k) measured ``trusted`` times is priced by its medians. A k
not trusted at a size is priced from those that are (the two nearest: linear in k; one: the slope
another size measured, else a prior), so the policy climbs one k at a time and never serves a k
that was measured to lose, except as a probe that is priced within ``probe_within`` of the best,
or, held at k = 0, one step in ``4 × probe_every`` at k = 1 (so that it notices a draft that has
become good). That probe drafts for one sequence only: the draft first catches up on every token
served since it last drafted, which for the whole batch would cost about what a k = 0 step saves
over a drafting one (its step is mixed, so its times are not kept; its acceptance is). The draft's
time of a step that caught up is not taken as what drafting k costs (``StepTimes.caught_up``).
Acceptance per draft position is the live moving average of the draft's chains
(as under ``goodput``: a prompt lookup's chains, which reach deep positions mostly where the text
repeats itself, would price a long draft as if it did too), each position starting from the one
before it (none measured: nothing is accepted). With several target replicas each learns its own step times
(coordinator/choose.py, ``learning_per_replica``): a mixed fleet fits no single table.

What it has learned is a profile (``snapshot()``), in the format ``specbatch profile`` writes:
``goodput`` over that file makes the same choices at its batch sizes. It is written under the
cache (coordinator/learned_store.py), loaded at the next start of the same pair on the same machine,
and served by ``Info``. The step times it keeps and prices are coordinator/learned_times.py's.
"""

from __future__ import annotations

from specbatch.protocol.profile import Profile
from specbatch.protocol.speculation import tally_positions

from .learned_times import LearnedTimes, bucket_sizes
from .policy import Goodput
from .step_times import StepTimes

# A deep position is reached by few drafts: its rate leans on the one before it as if this many
# of its drafts had been seen at that rate. Without it, the few drafts that reach position 4 or 5
# price it at 0 or 1, and a low price keeps k short, so that the position is reached less still.
PRIOR_DRAFTS = 4


class LearnedAcceptance:
    """P(draft position i accepted | the ones before were), as a moving average of the drafts
    that reached i (half the weight from the last ``half_life``), with no starting value: the
    first position starts at 0, each later one at the rate of the one before it, which it leans
    on as ``PRIOR_DRAFTS`` drafts' worth."""

    def __init__(self, positions: int, half_life: float = 64.0, start: list[float] | None = None):
        self.keep = 0.5 ** (1.0 / half_life)
        self.sums, self.weights = [0.0] * positions, [0.0] * positions
        for i, rate in enumerate((start or [])[:positions]):  # a loaded profile's, as one draft's worth
            self.sums[i], self.weights[i] = rate * (1 - self.keep), 1 - self.keep

    def observe(self, outcomes: list[tuple[int, int]]) -> None:
        reached, accepted = tally_positions(outcomes, len(self.sums))
        for i, (n, m) in enumerate(zip(reached, accepted)):
            if n:
                weight = self.keep**n
                self.sums[i] = weight * self.sums[i] + (1 - weight) * m / n
                self.weights[i] = weight * self.weights[i] + (1 - weight)

    @property
    def rates(self) -> list[float]:
        rates, last = [], 0.0
        prior = PRIOR_DRAFTS * (1 - self.keep)
        for i, (total, weight) in enumerate(zip(self.sums, self.weights)):
            if i:
                last = (total + prior * last) / (weight + prior)
            elif weight:
                last = total / weight
            rates.append(last)
        return rates

    def reached(self, position: int) -> bool:
        return self.weights[position] > 0


class Learning(Goodput):
    """``learn``: goodput over step times and acceptance measured while serving (see the module
    docstring). ``seed``: a profile learned before for this pair and machine, to start from."""

    def __init__(self, max_k: int, max_batch_size: int, max_leaves: int = 0, probe_every: int = 8,
                 half_life: float = 64.0, window: int = 32, trusted: int = 4, seed: Profile | None = None):
        self.learned_times = LearnedTimes(bucket_sizes(max_batch_size), window, trusted)
        start = list(seed.acceptance_by_position) if seed else None
        self.learned_acceptance = LearnedAcceptance(max_k, half_life, start)
        if seed is not None:
            self.learned_times.seed(seed)
        # batch size -> (step, its probe, whether one sequence alone drafts it)
        self._probes: dict[int, tuple[int, int | None, bool]] = {}
        self._one_row: tuple[int, int] | None = None  # (step, batch size) once that sequence took its probe
        # No profile file: Goodput prices by ``times`` and ``acceptance``, set in ``_sync``.
        super().__init__(None, max_k, half_life, probe_every, max_leaves, live_times=False)

    @property
    def steps(self) -> int:
        """Steps observed so far: what the probes and the choice keep time by."""
        return self.learned_times.steps

    def _sync(self):
        self.acceptance, self.times = self.learned_acceptance, self.learned_times

    def _climb_limit(self) -> int:
        """The largest k priced: one past the largest measured at any size, so that the policy
        climbs one k at a time."""
        measured = (k for ks in self.learned_times.target.values.values() for k in ks)
        return min(self.max_k, max(measured, default=0) + 1)

    def _best(self, batch_size: int, acceptance) -> tuple[int, int]:
        """The best of the ks measured at this batch size (and k = 0): a k only priced, not
        measured, is served as a probe first (``_probe``), never as the choice."""
        times = self.learned_times
        if not times.known():
            return 0, 0
        served = [k for k in range(self._climb_limit() + 1) if not k or times.measured(batch_size, k) >= times.trusted]
        choices = [(k, leaves) for k in served for leaves in self._leaf_choices(k, len(self.leaf_ranks.sums))]
        return max(choices, key=lambda c: (self.goodput(batch_size, c[0], acceptance, c[1]), -c[0], -c[1]))

    def leaves_for(self, batch_size: int, k: int, most: int) -> int:
        """As ``Goodput``'s; none before a step is measured (a request's own k asks before any)."""
        if not self.learned_times.known():
            return 0
        return super().leaves_for(batch_size, k, most)

    def _leaf_choices(self, k: int, most: int) -> range:
        return range(max(0, min(most, self._climb_limit() - k)) + 1 if k else 1)

    def _choice(self, batch_size: int) -> tuple[int, int]:
        """The best (k, leaves), chosen anew every ``probe_every`` steps (acceptance and times
        move slowly, and pricing every k costs the step loop time); on a probe step, the probe."""
        self._sync()
        if batch_size not in self._chosen:
            self._chosen[batch_size] = self._best(batch_size, self.acceptance.rates)
        choice = self._chosen[batch_size]
        if self._probe_step(batch_size, choice):
            # decided once a step: it is asked for each sequence's k and leaves
            if self._probes.get(batch_size, (None,))[0] != self.steps:
                self._probes[batch_size] = (self.steps, *self._probe(batch_size, choice))
            probe = self._probes[batch_size][1]
            if probe is not None and self._one_row != (self.steps, batch_size):
                return probe, 0
        return choice

    def probing(self, batch_size: int) -> bool:
        """Whether this step's k at ``batch_size`` is a probe. Asked before ``k_for``: once a
        sequence has taken a probe that one sequence alone drafts, the others are given the choice."""
        return self._choice(batch_size) != self._chosen[batch_size]

    def _probe_step(self, batch_size: int, choice: tuple[int, int]) -> bool:
        """Whether this step probes: one in ``probe_every``; and while a neighbour of the chosen k
        is not yet trusted at this size, the last ``trusted`` steps of every ``probe_every``, so
        that the choice made next can already serve it. Otherwise a new pair (or batch size)
        climbs one k per ``trusted × probe_every`` steps, longer than a short burst of traffic
        lasts. The probes run back to back: only the first reads what the draft missed at k = 0
        (a step that alternated would fold that catch-up into every drafting time it keeps)."""
        if self.steps % self.probe_every == self.probe_every - 1:
            return True
        if self.steps % self.probe_every < self.probe_every - self.learned_times.trusted:
            return False
        times = self.learned_times
        return any(times.measured(batch_size, k) < times.trusted
                   for k in (choice[0] + 1, choice[0] - 1) if 0 <= k <= self.max_k)

    def k_for(self, batch_size: int) -> int:
        k = self._choice(batch_size)[0]
        step, probe, one_row = self._probes.get(batch_size, (None, None, False))
        if one_row and step == self.steps and k == probe:
            self._one_row = (self.steps, batch_size)  # this sequence probes; the rest do not
        return k

    def _probe(self, batch_size: int, choice: tuple[int, int]) -> tuple[int | None, bool]:
        """A neighbour of the chosen k to measure (asked one step in ``probe_every``), and whether
        one sequence alone drafts it: one not yet trusted at this size (the larger first), by the
        whole batch; once both are, one step in four of those (one in 32) the one measured least
        of those priced within ``probe_within`` of the best, to keep their prices current at a
        quarter of the cost, from k = 0 by one sequence (the module docstring); k = 0 among them
        whatever its price."""
        times = self.learned_times
        neighbours = [k for k in (choice[0] + 1, choice[0] - 1) if 0 <= k <= self.max_k]
        unmeasured = [k for k in neighbours if times.measured(batch_size, k) < times.trusted]
        if unmeasured:
            return unmeasured[0], False
        if self.steps % (4 * self.probe_every) != 4 * self.probe_every - 1:
            return None, False
        one_row = choice[0] == 0 and batch_size > 1
        near = self._worth_probing(batch_size, choice, [*neighbours, 0])
        if near:
            return min(near, key=lambda k: times.measured(batch_size, k)), one_row
        # Held at k = 0, nothing new is drafted: a probe drafts one token, so that a draft (or a
        # text) that has become predictable is noticed.
        return (1, one_row) if choice[0] == 0 else (None, False)

    def observe(self, outcomes: list[tuple[int, int]]) -> None:
        self._sync()
        self.acceptance.observe(outcomes)

    def observe_first_rejections(self, ranks: list[int | None]) -> None:
        self.leaf_ranks.observe(ranks)

    def observe_times(self, times: StepTimes) -> None:
        self.learned_times.observe(times, mixed=self._one_row is not None and self._one_row[0] == self.steps)
        if self.steps % self.probe_every == 0:
            self._chosen.clear()

    def snapshot(self, **about) -> Profile | None:
        """What has been learned, as a profile (None before anything is measured)."""
        rates = self.acceptance.rates
        return self.learned_times.profile(rates, self._climb_limit(), workload={
            "learned": True, "steps": self.learned_times.steps}, **about)

    def describe(self) -> str:
        return "learn"
