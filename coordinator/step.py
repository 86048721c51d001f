"""One speculative decode step over the running batch: propose -> verify -> accept.

The policy chooses each request's k (and the leaves beside its first draft); the proposers fill
the chains, in order: prompt lookup in the request's own history, the proposal a draft hosted in
the target's process made in the last Verify, the shared index of finished requests' texts, then
the draft service for the rest (coordinator/proposers.py); the target
verifies every chain in one Verify per replica (coordinator/services.py); each verdict is applied
to its request's history and counted (coordinator/accept.py); the policy learns from what the
step kept and took.
"""

from __future__ import annotations

import time
from collections import Counter

from specbatch.config.speculation import SpeculationConfig

from .accept import Tally, accept
from .chain import DRAFT, LOOKUP, Chain, room
from .policy import PerReplica
from .proposers import (
    AheadProposer,
    DraftProposer,
    PromptLookupProposer,
    Proposer,
    SharedLookupProposer,
    prefers_draft,
)
from .requests import Request
from .stats import StepStats
from .step_times import StepTimes


class DecodeStep:
    def __init__(self, services, policy, speculation: SpeculationConfig, max_context: int):
        """``services``: coordinator.services.Services. ``policy``: the k policy
        ``speculation.k_policy`` names (coordinator/policy.py)."""
        self.policy = policy
        self.speculation = speculation.resolved()
        self.max_context = max_context
        self.services = services
        # Where a request's own history has no match, finished requests' texts (if kept).
        self.shared = (SharedLookupProposer(self.speculation.shared_lookup, self.speculation.prompt_lookup)
                       if self.speculation.shared_lookup else None)
        self.first_proposers: list[Proposer] = ([PromptLookupProposer(self.speculation.prompt_lookup), AheadProposer()]
                                                + ([self.shared] if self.shared else []))
        self.draft = DraftProposer(services)
        self.drafted_last = False  # whether the step before this one speculated (any k > 0)

    def run(self, batch: list[Request]) -> StepStats:
        """One propose -> verify -> accept step over ``batch`` (every request placed on a target)."""
        start = time.perf_counter()
        # A policy per target replica chooses for its replica's share of the batch.
        shares = Counter(request.target_replica for request in batch) if self.per_replica else None
        chains = [self.chain(request, shares[request.target_replica] if shares else len(batch)) for request in batch]
        for proposer in self.first_proposers:
            proposer.propose(chains, len(batch))
        proposing = time.perf_counter()  # the choices above are the step's own work, not the draft's
        draft_compute = self.draft.propose(chains, len(batch))
        # A draft hosted in the target's process drafts the next step in this Verify: as many as
        # this step's k, within the context were every draft kept (the next step's own room cuts
        # the proposal as a Propose of its k would draft it: the same tokens). None after a lookup
        # chain where lookup's chains keep more (its next will be used), nor at a step that follows
        # one at k = 0 (a policy's probe, mostly: the next step is likely k = 0 again).
        speculating = any(chain.k for chain in chains)
        for chain in chains:
            lookup_leads = chain.source == LOOKUP and not prefers_draft(chain.request)
            chain.next_k = 0 if lookup_leads or not self.drafted_last else min(
                chain.k, max(self.max_context - len(chain.request.history) - len(chain.tokens) - 2, 0))
        self.drafted_last = speculating
        drafted = time.perf_counter()
        verdicts, target_compute = self.services.verify(chains)
        # A hosted draft drafted the next step inside the Verify (replicas side by side: the
        # slowest): its time is the draft's part of the step, not the target's (so that a verify
        # row, a leaf's price, is the target's own).
        ahead = self.services.ahead_compute
        slowest = max(ahead.values(), default=0.0)
        draft_compute += slowest
        for chain, verdict in zip(chains, verdicts):
            chain.verdict = verdict
        verified = time.perf_counter()
        parts = self._parts(chains)
        tallies = {replica: accept(part) for replica, part in parts.items()}
        for replica, tally in tallies.items():
            self._learn(self.policy_of(replica), tally)
        tally = Tally.joined(list(tallies.values()))
        ended = time.perf_counter()
        verify_wall = 1e3 * (verified - drafted)
        for replica, part in parts.items():
            if tallies[replica].ks:  # what the step's parts took, for a policy that learns step times
                # (its replica's own Verify under PerReplica; else, replica None, the step's). The
                # step as its replica's: another replica's slower Verify, waited for side by side,
                # is not this one's time outside its calls.
                call_ms = self.services.verify_ms.get(replica, verify_wall)
                ahead_ms = 1e3 * ahead.get(replica, slowest)
                self.policy_of(replica).observe_times(_step_times(
                    part, 1e3 * (drafted - proposing) + ahead_ms, call_ms - ahead_ms,
                    1e3 * (ended - start) - verify_wall + call_ms))
        return tally.stats(drafted - start + slowest, verified - drafted - slowest, ended - start, draft_compute,
                           target_compute)

    @property
    def per_replica(self) -> bool:
        return isinstance(self.policy, PerReplica)

    def policy_of(self, replica):
        """The policy that prices steps on target ``replica``: its own under PerReplica, else the one."""
        return self.policy.of(replica) if self.per_replica else self.policy

    def _parts(self, chains: list[Chain]) -> dict:
        """The step's chains by target replica under a policy per replica; else all as one."""
        if not self.per_replica:
            return {None: chains}
        parts: dict = {}
        for chain in chains:
            parts.setdefault(chain.request.target_replica, []).append(chain)
        return parts

    def chain(self, request: Request, batch_size: int) -> Chain:
        """What the policy allows ``request`` this step: its k and, should the draft propose for
        it, the leaves beside the first draft. ``batch_size``: the sequences its policy prices
        the step for."""
        chain = Chain(request, self.k_for(request, batch_size), room(request, self.max_context))
        chain.leaves, chain.verified_leaves = self.leaves_for(request, chain.k, batch_size)
        return chain

    def k_for(self, request: Request, batch_size: int) -> int:
        """The k this request drafts this step: its own fixed k or the policy's, within its limits.
        Greedy and sampled requests alike (sampled ones are verified by rejection sampling)."""
        if request.fixed_k is not None:
            k = request.fixed_k
        else:
            k = self.policy_of(request.target_replica).k_for(batch_size)
            if self.per_replica:
                self.policy.chosen[request.target_replica] = k
        return min(k, room(request, self.max_context))

    def leaves_for(self, request: Request, k: int, batch_size: int) -> tuple[int, int]:
        """For a request drafting k: how many next-best tokens the draft proposes at the first
        drafted position, and how many of them the target verifies (where the context has room
        for the columns they take on the target). A request's own count is verified whole."""
        if not k:
            return 0, 0
        space = self.max_context - len(request.history) - 1 - k
        if request.fixed_leaves is not None:
            return (leaves := max(min(request.fixed_leaves, space), 0)), leaves
        most = max(min(self.speculation.leaves, space), 0)
        return most, self.policy_of(request.target_replica).leaves_for(batch_size, k, most) if most else 0

    @staticmethod
    def _learn(policy, tally: Tally) -> None:
        policy.observe(tally.outcomes)  # the draft's acceptance: a lookup's says nothing of it
        if tally.first_rejections:
            policy.observe_first_rejections(tally.first_rejections)

    def finished(self, request: Request) -> None:
        """A request that ended with its output: its history joins the shared index (if kept)."""
        if self.shared is not None:
            self.shared.finished(request)


def _step_times(chains: list[Chain], draft_ms: float, target_ms: float, step_ms: float) -> StepTimes:
    drafting = [chain for chain in chains if chain.source == DRAFT and chain.tokens]
    return StepTimes(len(chains), len(drafting), max((chain.k for chain in drafting), default=0),
                     max(chain.verify_width for chain in chains), draft_ms, target_ms, step_ms,
                     max((chain.draft_read for chain in drafting), default=0))
