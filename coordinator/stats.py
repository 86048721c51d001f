"""What one decode step did, recorded once (vLLM's SpecDecodingStats is the pattern), and the
running totals that Info and the benchmarks read. The scheduler's totals, the metrics and the
profiler all read the same record, so they cannot count a step differently."""

from __future__ import annotations

from dataclasses import dataclass, field

from specbatch.protocol.speculation import MAX_K, tally_positions


@dataclass
class StepStats:
    """One decode step. ``ks``: the k each stepped sequence drafted (0: target-only for it).
    ``outcomes``: (drafted, accepted) per sequence that drafted. Times are wall seconds of the
    step's Propose calls, its Verify calls and the whole step; the compute seconds are what the
    services report of them (replicas side by side: the slowest one's)."""

    batch_size: int  # sequences that stepped
    ks: list[int]
    outcomes: list[tuple[int, int]]
    draft_seconds: float
    target_seconds: float
    step_seconds: float
    draft_compute_seconds: float = 0.0
    target_compute_seconds: float = 0.0
    # Sequences whose chain stopped at a position that had leaves; of those, the ones that kept a leaf.
    leaf_chances: int = 0
    leaf_hits: int = 0
    # (drafted, accepted) of each chain found by prompt lookup (not in ``outcomes``: those are the draft's).
    lookup_outcomes: list[tuple[int, int]] = field(default_factory=list)
    # Of those, the chains found in other requests' texts (shared lookup).
    shared_lookup_outcomes: list[tuple[int, int]] = field(default_factory=list)
    # Per draft position: drafts that reached it (every earlier position accepted), and of those,
    # the ones accepted there.
    reached_by_position: list[int] = field(init=False)
    accepted_by_position: list[int] = field(init=False)

    def __post_init__(self):
        # A draft of 0 tokens is no draft.
        self.outcomes = [(drafted, accepted) for drafted, accepted in self.outcomes if drafted > 0]
        self.reached_by_position, self.accepted_by_position = tally_positions(self.outcomes, MAX_K)

    @property
    def draft_tokens(self) -> int:
        return sum(drafted for drafted, _ in self.outcomes)

    @property
    def accepted_tokens(self) -> int:
        return sum(accepted for _, accepted in self.outcomes)

    @property
    def lookup_draft_tokens(self) -> int:
        return sum(drafted for drafted, _ in self.lookup_outcomes)

    @property
    def lookup_accepted_tokens(self) -> int:
        return sum(accepted for _, accepted in self.lookup_outcomes)

    @property
    def shared_lookup_draft_tokens(self) -> int:
        return sum(drafted for drafted, _ in self.shared_lookup_outcomes)

    @property
    def shared_lookup_accepted_tokens(self) -> int:
        return sum(accepted for _, accepted in self.shared_lookup_outcomes)


@dataclass
class StepTotals:
    """Cumulative step timing, for Info and the benchmark (the fields of specbatch.v1.StepTotals)."""

    steps: int = 0
    sequence_steps: int = 0  # sum of batch sizes over steps
    step_seconds: float = 0.0  # whole decode steps, as the coordinator sees them
    draft_seconds: float = 0.0  # Propose calls, RPC included, and a hosted draft's drafting inside Verify
    target_seconds: float = 0.0  # Verify calls, RPC included, less a hosted draft's drafting
    draft_compute_seconds: float = 0.0  # of which the draft service reports computing
    target_compute_seconds: float = 0.0  # of which the target service reports computing
    prefill_seconds: float = 0.0
    # Per draft position: drafts that reached it (every earlier position accepted), and of
    # those, the ones accepted there. Conditional acceptance at i is accepted[i] / reached[i].
    reached_by_position: list[int] = field(default_factory=lambda: [0] * MAX_K)
    accepted_by_position: list[int] = field(default_factory=lambda: [0] * MAX_K)
    k_histogram: list[int] = field(default_factory=lambda: [0] * (MAX_K + 1))  # sequence-steps by k
    leaf_chances: int = 0  # chains stopped at a position with leaves
    leaf_hits: int = 0  # and of those, leaves kept
    lookup_chains: int = 0  # sequence-steps whose drafts came from prompt lookup, not the draft
    lookup_drafted: int = 0  # tokens those chains drafted
    lookup_accepted: int = 0  # and of those, the ones the target kept
    shared_lookup_chains: int = 0  # of the lookup chains, those found in other requests' texts
    shared_lookup_drafted: int = 0
    shared_lookup_accepted: int = 0

    def add(self, step: StepStats) -> None:
        self.steps += 1
        self.lookup_chains += len(step.lookup_outcomes)
        self.lookup_drafted += step.lookup_draft_tokens
        self.lookup_accepted += step.lookup_accepted_tokens
        self.shared_lookup_chains += len(step.shared_lookup_outcomes)
        self.shared_lookup_drafted += step.shared_lookup_draft_tokens
        self.shared_lookup_accepted += step.shared_lookup_accepted_tokens
        self.leaf_chances += step.leaf_chances
        self.leaf_hits += step.leaf_hits
        self.sequence_steps += step.batch_size
        self.step_seconds += step.step_seconds
        self.draft_seconds += step.draft_seconds
        self.target_seconds += step.target_seconds
        self.draft_compute_seconds += step.draft_compute_seconds
        self.target_compute_seconds += step.target_compute_seconds
        for i in range(MAX_K):
            self.reached_by_position[i] += step.reached_by_position[i]
            self.accepted_by_position[i] += step.accepted_by_position[i]
        for k in step.ks:
            self.k_histogram[k] += 1
