"""One speculative decode step over the running batch: propose -> verify -> accept.

The policy chooses each request's k (and the leaves beside its first draft); the proposers fill
the chains, in order: prompt lookup in the request's own history, the shared index of finished
requests' texts, then the draft service for the rest (coordinator/proposers.py); the target
verifies every chain in one Verify per replica (coordinator/services.py); each verdict is applied
to its request's history and counted (coordinator/accept.py); the policy learns from what the
step kept and took.
"""

from __future__ import annotations

import time

from specbatch.config.speculation import SpeculationConfig

from .accept import Tally, accept
from .chain import DRAFT, Chain, room
from .policy import StepTimes
from .proposers import DraftProposer, PromptLookupProposer, Proposer, SharedLookupProposer
from .requests import Request
from .stats import StepStats


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
        self.lookups: list[Proposer] = ([PromptLookupProposer(self.speculation.prompt_lookup)]
                                        + ([self.shared] if self.shared else []))
        self.draft = DraftProposer(services)

    def run(self, batch: list[Request]) -> StepStats:
        """One propose -> verify -> accept step over ``batch`` (every request placed on a target)."""
        start = time.perf_counter()
        chains = [self.chain(request, len(batch)) for request in batch]
        for lookup in self.lookups:
            lookup.propose(chains, len(batch))
        proposing = time.perf_counter()  # the choices above are the step's own work, not the draft's
        draft_compute = self.draft.propose(chains, len(batch))
        drafted = time.perf_counter()
        verdicts, target_compute = self.services.verify(chains)
        for chain, verdict in zip(chains, verdicts):
            chain.verdict = verdict
        verified = time.perf_counter()
        tally = accept(chains)
        self._learn(tally)
        ended = time.perf_counter()
        if tally.ks:  # what the step's parts took, for a policy that learns step times
            self.policy.observe_times(_step_times(chains, 1e3 * (drafted - proposing), 1e3 * (verified - drafted),
                                                  1e3 * (ended - start)))
        return tally.stats(drafted - start, verified - drafted, ended - start, draft_compute, target_compute)

    def chain(self, request: Request, batch_size: int) -> Chain:
        """What the policy allows ``request`` this step: its k and, should the draft propose for
        it, the leaves beside the first draft."""
        chain = Chain(request, self.k_for(request, batch_size), room(request, self.max_context))
        chain.leaves, chain.verified_leaves = self.leaves_for(request, chain.k, batch_size)
        return chain

    def k_for(self, request: Request, batch_size: int) -> int:
        """The k this request drafts this step: its own fixed k or the policy's, within its limits.
        Greedy and sampled requests alike (sampled ones are verified by rejection sampling)."""
        k = request.fixed_k if request.fixed_k is not None else self.policy.k_for(batch_size)
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
        return most, self.policy.leaves_for(batch_size, k, most) if most else 0

    def _learn(self, tally: Tally) -> None:
        self.policy.observe(tally.outcomes)  # the draft's acceptance: a lookup's says nothing of it
        if tally.first_rejections:
            self.policy.observe_first_rejections(tally.first_rejections)

    def finished(self, request: Request) -> None:
        """A request that ended with its output: its history joins the shared index (if kept)."""
        if self.shared is not None:
            self.shared.finished(request)


def _step_times(chains: list[Chain], draft_ms: float, target_ms: float, step_ms: float) -> StepTimes:
    drafting = [chain for chain in chains if chain.source == DRAFT and chain.tokens]
    return StepTimes(len(chains), len(drafting), max((chain.k for chain in drafting), default=0),
                     max(chain.verify_width for chain in chains), draft_ms, target_ms, step_ms)
