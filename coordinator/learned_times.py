"""Step times per (batch size, k) as the ``learn`` policy measures them while serving
(coordinator/learned.py): each part of a step (the draft's, the target's, and what lies outside
the two calls) in windows of its last measurements per kept batch size, priced by their medians,
and a k not measured at a size priced from those that are. What ``Goodput`` asks of a profile."""

from __future__ import annotations

import math
import statistics
from collections import deque

from specbatch.protocol.profile import Profile, build_profile, expected_tokens

from .step_times import StepTimes

# Before a size has two measured ks: what one more draft a sequence adds to a Verify, as a share
# of the Verify at the k measured; before any Propose is measured, what a drafted token costs the
# draft, as a share of the target-only Verify (with one k measured, the draft's time is taken in
# proportion to k). Priors only choose what to measure first; every k served is priced by
# measurement.
PRIOR_VERIFY_SLOPE = 0.1
PRIOR_DRAFT_PER_TOKEN = 0.3



def nearest_size(sizes, size: float) -> int:
    """Of ``sizes``, the one nearest ``size`` by ratio (3 is nearer 4 than 2; a tie goes to the
    smaller)."""
    return min(sizes, key=lambda b: (abs(math.log(b / max(size, 1.0))), b))


def bucket_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes a learned profile keeps: 1, 2, 3, 4, 6, 8, 12, 16, 24 … (the powers of two and
    the points halfway between) up to the coordinator's batch. A step's times are kept at the size
    nearest its batch: with powers of two alone, a batch of 12 was kept at 16, and the steps of a
    round's tail priced a full batch's Verify a quarter too cheap."""
    sizes, b = {max(max_batch_size, 1)}, 1
    while b < max_batch_size:
        sizes.update(s for s in (b, b + b // 2) if s < max_batch_size)
        b *= 2
    return tuple(sorted(sizes))


class Windows:
    """The last ``window`` measurements per (size, k) of one part of a step."""

    def __init__(self, window: int, trusted: int):
        self.window, self.trusted = window, trusted
        self.values: dict[int, dict[int, deque]] = {}  # size -> k -> ms
        # Medians until the next measurement at their size: a choice prices every k in turn.
        self._medians: dict[int, dict[int, float]] = {}
        self._sizes: list[int] | None = None

    def add(self, size: int, k: int, ms: float) -> None:
        self.values.setdefault(size, {}).setdefault(k, deque(maxlen=self.window)).append(ms)
        self._medians.pop(size, None)
        self._sizes = None

    def count(self, size: int, k: int) -> int:
        return len(self.values.get(size, {}).get(k, ()))

    def medians(self, size: int) -> dict[int, float]:
        """{k: median} of the ks trusted at ``size``."""
        if size not in self._medians:
            self._medians[size] = {k: statistics.median(v) for k, v in self.values.get(size, {}).items()
                                   if len(v) >= self.trusted}
        return self._medians[size]

    def sizes(self) -> list[int]:
        if self._sizes is None:
            self._sizes = sorted(size for size in self.values if self.medians(size))
        return self._sizes


def _priced(medians: dict[int, float], k: int, slope: float | None, prior: float | None) -> float:
    """A part's time at k from the trusted ``medians`` of one size: measured; else linear in k
    through the two nearest (never falling with k); else from the one measured, at ``slope`` (ms
    per k, another size's), or ``prior`` (a share of it per k; None: in proportion to k)."""
    if k in medians:
        return medians[k]
    nearest = sorted(medians, key=lambda m: (abs(m - k), m))
    if len(nearest) >= 2:
        a, b = sorted(nearest[:2])
        per_k = max(0.0, (medians[b] - medians[a]) / (b - a))
        near = nearest[0]
        return max(0.0, medians[near] + per_k * (k - near))
    (near,) = nearest
    if slope is None and prior is None:
        return medians[near] * k / near if near else medians[near]
    per_k = slope if slope is not None else prior * medians[near]
    return max(0.0, medians[near] + per_k * (k - near))


def _slope(medians: dict[int, float]) -> float | None:
    """ms per k between the two lowest ks trusted, where two are."""
    if len(medians) < 2:
        return None
    a, b = sorted(medians)[:2]
    return max(0.0, (medians[b] - medians[a]) / (b - a))


class LearnedTimes:
    """Step times per (batch size, k) as served: what ``Goodput`` asks of a profile."""

    def __init__(self, sizes: tuple[int, ...], window: int = 32, trusted: int = 4):
        self.sizes, self.trusted = sizes, trusted
        self.draft, self.target = Windows(window, trusted), Windows(window, trusted)
        # (size, whether the draft was asked) -> ms outside the two calls: a step that asks the
        # draft makes one more call, and relays features, beside a k = 0 step.
        self.rest: dict[tuple[int, bool], deque] = {}
        self.window = window
        self.steps = 0
        self._cache: dict = {}

    def size(self, batch_size: float) -> int:
        """The kept size nearest ``batch_size`` (by ratio: 3 is nearer 4 than 2)."""
        return nearest_size(self.sizes, batch_size)

    def observe(self, t: StepTimes, mixed: bool = False) -> None:
        """``mixed``: a step whose sequences drafted different ks for the policy's own reasons
        (a probe of one sequence): counted, its times not kept."""
        if mixed:
            self.steps += 1
            return
        if not t.batch_size:
            return
        size = self.size(t.batch_size)
        if t.draft_k and t.draft_rows and not t.caught_up:
            self.draft.add(self.size(t.draft_rows), t.draft_k, t.draft_ms)
        self.target.add(size, t.verify_k, t.target_ms)
        self.rest.setdefault((size, bool(t.draft_k and t.draft_rows)), deque(maxlen=self.window)).append(
            max(0.0, t.step_ms - t.draft_ms - t.target_ms))
        self.steps += 1
        self._cache.clear()

    def seed(self, profile: Profile) -> None:
        """Start from a profile of this pair on this machine (one learned before): each of its
        cells as ``trusted`` measurements, which served steps then replace."""
        for (b, k), cell in profile.cells.items():
            size = self.size(b)
            for _ in range(self.trusted):
                self.target.add(size, k, cell.target_ms)
                if k:
                    self.draft.add(size, k, cell.draft_ms)
                if k <= 1:
                    self.rest.setdefault((size, bool(k)), deque(maxlen=self.window)).append(
                        max(0.0, cell.step_ms - cell.draft_ms - cell.target_ms))
        self._cache.clear()

    def measured(self, batch_size: float, k: int) -> int:
        return self.target.count(self.size(batch_size), k)

    def known(self) -> list[int]:
        """The sizes with a trusted Verify time: a snapshot's batch sizes."""
        return self.target.sizes()

    def _part(self, windows: Windows, size: int, k: int, prior: float | None) -> float:
        key = (id(windows), size, k)
        if key not in self._cache:
            medians = windows.medians(size)
            if not medians:  # nothing at this size: the nearest size that has some
                sizes = windows.sizes()
                medians = windows.medians(nearest_size(sizes, size))
            slopes = [s for s in (_slope(windows.medians(b)) for b in windows.sizes()) if s is not None]
            other = None
            if len(medians) == 1 and slopes:  # another size's slope, scaled to this size's time
                nearest = nearest_size([b for b in windows.sizes() if _slope(windows.medians(b)) is not None], size)
                at = windows.medians(nearest)
                (k0,) = medians
                reference = at.get(k0) or min(at.values())
                other = _slope(at) * medians[k0] / reference if reference else None
            self._cache[key] = _priced(medians, k, other, prior)
        return self._cache[key]

    def target_ms(self, batch_size: float, k: int) -> float:
        return self._part(self.target, self.size(batch_size), k, PRIOR_VERIFY_SLOPE)

    def draft_ms(self, batch_size: float, k: int) -> float:
        if not k:
            return 0.0
        size = self.size(batch_size)
        if not self.draft.sizes():  # no Propose measured: a share of the Verify per drafted token
            return self.target_ms(batch_size, 0) * PRIOR_DRAFT_PER_TOKEN * k
        return self._part(self.draft, size, k, None)

    def rest_ms(self, batch_size: float, k: int = 0) -> float:
        """What a step at k takes outside its two calls, from the steps that asked the draft (for
        k > 0) or did not (k = 0): their median at this size; else the other kind's here plus
        what asking the draft added where both were measured; else the nearest size's."""
        size, drafting = self.size(batch_size), k > 0
        key = ("rest", size, drafting)
        if key not in self._cache:
            self._cache[key] = self._rest(size, drafting)
        return self._cache[key]

    def _rest(self, size: int, drafting: bool) -> float:
        def median(at: int, kind: bool) -> float:
            return statistics.median(self.rest[(at, kind)])

        def nearest(kind: bool, among=None) -> int | None:
            sizes = [b for b, d in self.rest if d == kind and (among is None or among(b))]
            return nearest_size(sizes, size) if sizes else None

        if (size, drafting) in self.rest:
            return median(size, drafting)
        both = nearest(True, lambda b: (b, False) in self.rest)
        added = 0.0 if both is None else median(both, True) - median(both, False)
        if (size, not drafting) in self.rest:
            return max(0.0, median(size, not drafting) + (added if drafting else -added))
        if (at := nearest(drafting)) is not None:
            return median(at, drafting)
        if (at := nearest(not drafting)) is not None:
            return max(0.0, median(at, not drafting) + (added if drafting else -added))
        return 0.0

    def step_ms(self, batch_size: float, k: int) -> float:
        return self.draft_ms(batch_size, k) + self.target_ms(batch_size, k) + self.rest_ms(batch_size, k)

    def profile(self, acceptance: list[float], max_k: int, **about) -> Profile | None:
        """What has been learned as a profile: every kept size with a trusted Verify, every k to
        ``max_k``, priced as the policy prices them; None before anything is trusted."""
        sizes = self.known()
        if not sizes:
            return None
        times = {(b, k): {"draft_ms": self.draft_ms(b, k), "target_ms": self.target_ms(b, k),
                          "step_ms": self.step_ms(b, k), "accepted_per_sequence": expected_tokens(acceptance, k) - 1}
                 for b in sizes for k in range(max_k + 1)}
        return build_profile(sizes, max_k, list(acceptance[:max_k]) + [0.0] * (max_k - len(acceptance)), times,
                             **about)
