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
    fill_from,
    prefers_draft,
    prefers_lookup,
)
from .requests import Request
from .services import hosted_draft
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

    def run(self, batch: list[Request], further_steps: int = 0) -> list[StepStats]:
        """One propose -> verify -> accept step over ``batch`` (every request placed on a target),
        and up to ``further_steps`` more in its Verify where every request may go on in them
        (``_goes_further``): the stats of each step run."""
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
        further_steps = further_steps if all(self._goes_further(chain) for chain in chains) else 0
        if further_steps:
            for chain in chains:
                chain.further = self._further(chain.request)
        drafted = time.perf_counter()
        verdicts, target_compute = self.services.verify(chains, further_steps)
        # The further steps' compute, off the first step's times (replicas side by side: the slowest).
        further = self.services.further
        further_seconds = {replica: sum(s.compute_seconds + s.draft_compute_seconds for s in steps)
                           for replica, steps in further.items()}
        later = max(further_seconds.values(), default=0.0)
        # A hosted draft drafted the next step inside the Verify (replicas side by side: the
        # slowest): its time is the draft's part of the step, not the target's (so that a verify
        # row, a leaf's price, is the target's own).
        ahead = self.services.ahead_compute
        slowest = max(ahead.values(), default=0.0)
        draft_compute += slowest
        for chain, verdict in zip(chains, verdicts):
            chain.verdict = verdict
        verified = time.perf_counter() - later
        parts = self._parts(chains)
        tallies = {replica: accept(part) for replica, part in parts.items()}
        for replica, tally in tallies.items():
            self._learn(self.policy_of(replica), tally)
        tally = Tally.joined(list(tallies.values()))
        ended = time.perf_counter() - later
        verify_wall = 1e3 * (verified - drafted)
        beyond_compute = 0.0  # the step's time beyond the services' compute, as a policy prices every step
        for replica, part in parts.items():
            if tallies[replica].ks:  # what the step's parts took, for a policy that learns step times
                # (its replica's own Verify less its own further steps under PerReplica; else, replica
                # None, the step's: verify_wall, the further steps already off it). The step as its
                # replica's: another replica's slower Verify, waited for side by side, is not this
                # one's time outside its calls.
                own = self.services.verify_ms.get(replica) if replica is not None else None
                call_ms = verify_wall if own is None else own - 1e3 * further_seconds.get(replica, 0.0)
                ahead_ms = 1e3 * ahead.get(replica, slowest)
                times = _step_times(part, 1e3 * (drafted - proposing) + ahead_ms, call_ms - ahead_ms,
                                    1e3 * (ended - start) - verify_wall + call_ms)
                beyond_compute = max(times.step_ms - 1e3 * (draft_compute + target_compute), 0.0)
                self.policy_of(replica).observe_times(times)
        first = tally.stats(drafted - start + slowest, verified - drafted - slowest, ended - start, draft_compute,
                            target_compute)
        return [first, *self._apply_further_steps(chains, further, beyond_compute)]

    def _goes_further(self, chain: Chain) -> bool:
        """Whether the chain's request may go on in this Verify's further steps: its k is not a
        policy's probe (which measures one step), and it drafts nothing (k = 0) or drafts with a draft
        hosted in the target's process that proposes its next chain of k in each step
        (coordinator/services.py), where prompt lookup does not lead for it.
        (Where its k is cut to what it can still use, the target stops it as a call a step would
        cut it: target_service/further.py.)"""
        request = chain.request
        if chain.probe:
            return False
        if not chain.k:
            return chain.source is None
        # Further steps draft with the hosted draft alone: not where prompt lookup's chains have
        # kept more for the request (code, where long runs repeat), which a call a step still tries.
        return (chain.source == DRAFT and chain.next_k == chain.k and hosted_draft(request)
                and not prefers_lookup(request))

    def _further(self, request: Request) -> tuple[int, int, list[int]] | None:
        """(the tokens the request may still generate, what its context still holds, its stop
        tokens): how far it may go in the call's further steps (FurtherSteps)."""
        most, room = request.max_new_tokens - request.generated, self.max_context - len(request.history)
        return (most, room, sorted(request.stop_token_ids)) if most >= 1 and room >= 1 else None

    def _apply_further_steps(self, chains: list[Chain], further: dict, beyond_compute: float) -> list[StepStats]:
        """The further steps' verdicts applied in order, as steps of their own: each request's chain
        is the proposal its last verdict carried (the drafts the target verified), with the first
        step's leaves. A request that finished on the way takes no more. ``beyond_compute``: the
        first step's time beyond the services' compute (its call, the coordinator's own work),
        which the policy is told each further step costs too: it prices every k as a call a step,
        as its probes (one step a call) and a profile are measured."""
        out = []
        for index in range(max((len(steps) for steps in further.values()), default=0)):
            started = time.perf_counter()
            steps = [replica_steps[index] for replica_steps in further.values() if index < len(replica_steps)]
            verdicts = {verdict.seq_id: verdict for step in steps for verdict in step.verdicts}
            target = max(step.compute_seconds for step in steps)
            draft = max(step.draft_compute_seconds for step in steps)
            stepped = []
            for first in chains:
                request = first.request
                verdict = verdicts.get(request.seq_id)
                if verdict is None or request.finish is not None:
                    continue
                chain = Chain(request, 0, room(request, self.max_context), verdict=verdict)
                if first.k:
                    chain.k = len(request.ahead.tokens)
                    fill_from(chain, request.ahead)
                    chain.leaves = first.leaves
                    chain.verified_leaves = len(first.leaves_to_verify[0]) if first.leaves_to_verify else 0
                stepped.append(chain)
            parts = self._parts(stepped)
            tallies = {replica: accept(part) for replica, part in parts.items()}
            for replica, tally in tallies.items():
                policy = self.policy_of(replica)
                self._learn(policy, tally)
                if tally.ks:
                    policy.observe_times(_step_times(parts[replica], 1e3 * draft, 1e3 * target + beyond_compute,
                                                     1e3 * (draft + target) + beyond_compute))
            tally = Tally.joined(list(tallies.values()))
            out.append(tally.stats(draft, target, draft + target + time.perf_counter() - started, draft, target))
        return out

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
        # Asked before the k: learn's probe that one sequence alone drafts is that sequence's alone.
        probe = request.fixed_k is None and self.policy_of(request.target_replica).probing(batch_size)
        chain = Chain(request, self.k_for(request, batch_size), room(request, self.max_context), probe=probe)
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
