"""One speculative decode step over the running batch: choose k per sequence, draft (one Propose
per draft replica), verify (one Verify per target replica), append what was accepted to each
request's history and stream it out.

A draft that fails or is missing makes its sequences target-only for the step (k = 0), which is
lossless; a target replica that fails leaves its sequences out of the step (they move and run
again next step).

Prompt lookup (``lookup`` > 0): where the history's last tokens occurred before in the request,
the tokens that followed them are the step's drafts and it skips its Propose (coordinator/lookup.py).
With a shared index (``shared``), where the request's own history has no match, the texts of
requests that finished before it are searched too.
"""

from __future__ import annotations

import logging
import time

import grpc

from specbatch.config.speculation import SpeculationConfig
from specbatch.protocol.speculation import MAX_K
from specbatch.v1 import model_services_pb2 as services_pb

from .backends import Call, lost_state, unreachable
from .lookup import PromptLookup, SharedLookup
from .placement import Placement, by_draft_replica, by_target_replica, call_timeout
from .policy import StepTimes
from .replicas import Replica
from .requests import Request
from .stats import StepStats

log = logging.getLogger(__name__)


class DecodeStep:
    def __init__(self, placement: Placement, policy, speculation: SpeculationConfig, max_context: int,
                 feature_row_bytes: int, metrics=None):
        self.placement = placement
        self.policy = policy  # the k policy speculation.k_policy names (coordinator/policy.py)
        self.speculation = speculation.resolved()
        self.max_context = max_context
        self.feature_row_bytes = feature_row_bytes  # 0 unless the draft reads target features
        self.metrics = metrics
        # Shared lookup: finished requests' texts, searched where a request's own has no match.
        self.shared = SharedLookup(self.speculation.shared_lookup) if self.speculation.shared_lookup else None

    def leaves_for(self, request: Request, k: int, batch_size: int) -> tuple[int, int]:
        """For a request drafting k: how many next-best tokens the draft proposes at the first
        drafted position, and how many of them the target verifies (where the context has room
        for the columns they take on the target). A request's own count is verified whole."""
        if not k:
            return 0, 0
        room = self.max_context - len(request.history) - 1 - k
        if request.fixed_leaves is not None:
            return (leaves := max(min(request.fixed_leaves, room), 0)), leaves
        most = max(min(self.speculation.leaves, room), 0)
        return most, self.policy.leaves_for(batch_size, k, most) if most else 0

    def k_for(self, request: Request, batch_size: int) -> int:
        """The k this request drafts this step: its own fixed k or the policy's, within its limits.
        Greedy and sampled requests alike (sampled ones are verified by rejection sampling)."""
        k = request.fixed_k if request.fixed_k is not None else self.policy.k_for(batch_size)
        return min(k, self._room(request))

    def _room(self, request: Request) -> int:
        """The most tokens this request may draft: each step yields accepted + 1 tokens, so no more
        than it can still use, and no more than its context holds."""
        return max(min(request.max_new_tokens - request.generated - 1, self.max_context - len(request.history) - 1,
                       MAX_K), 0)

    def lookup_drafts(self, request: Request, k: int, batch_size: int) -> tuple[list[int], bool] | None:
        """Drafts copied from the request's own history (prompt lookup), else from other requests'
        (the shared index, where kept and the request is in it), where it speculates this step and
        they are found: (drafts, whether shared); None otherwise; within the request's --prompt-lookup. Alone in the
        batch, up to twice the step's k: its lookup spares the step's only draft call, and its runs
        are long. Beside others, up to k: the Propose happens anyway, and the batch's verify rows
        stay what the policy chose (at batch 4, chains of 2k read no faster than k=1 alone)."""
        most = min(self.speculation.prompt_lookup if request.prompt_lookup is None else request.prompt_lookup,
                   (2 if batch_size == 1 else 1) * k, self._room(request))
        if most <= 0:  # k = 0 too: it does not speculate this step
            return None
        if request.lookup is None:
            request.lookup = PromptLookup()
        if found := request.lookup.drafts(request.history, most):
            return found, False
        if self.shared is not None and request.shared_lookup:
            if found := self.shared.drafts(request.history, most):
                return found, True
        return None

    def finished(self, request: Request) -> None:
        """A request that ended with its output: its history joins the shared index (if kept and
        the request is in it)."""
        if self.shared is not None and request.shared_lookup and request.generated:
            self.shared.add(request.history)

    def run(self, batch: list[Request]) -> StepStats:
        """One draft → verify → accept step over ``batch`` (every request placed on a target)."""
        start = time.perf_counter()
        ks = [self.k_for(r, len(batch)) for r in batch]
        # Drafts found by prompt lookup: no Propose for them.
        looked_up = [self.lookup_drafts(r, k, len(batch)) for r, k in zip(batch, ks)]
        ready = [found[0] if found else None for found in looked_up]
        leaves = [self.leaves_for(r, k, len(batch)) if drafts is None else (0, 0)
                  for r, k, drafts in zip(batch, ks, ready)]
        proposing = time.perf_counter()  # the choices above are the step's own work, not the draft's
        proposed, proposed_q, next_best, draft_cached_len, draft_compute = self._propose(
            batch, ks, [[most] if most else [] for most, _ in leaves], ready)
        drafted = time.perf_counter()
        calls = [Call(r.seq_id, r.target_len, r.history[r.target_len :]) for r in batch]
        verified_leaves = [self._leaves_to_verify(at, verified) for at, (_, verified) in zip(next_best, leaves)]
        verdicts, target_compute = self._verify(batch, calls, proposed, proposed_q, verified_leaves)
        verified = time.perf_counter()
        outcomes = []  # (drafted, accepted) of each sequence the draft drafted for: what the policy learns from
        lookup_outcomes = []  # the same of each chain found by prompt lookup
        shared_lookup_outcomes = []  # and of those, the ones found in other requests' texts
        stepped_ks = []  # the k each stepped sequence drafted
        first_rejections = []  # rank of the target's token among the draft's next-best ones, at each rejected first draft
        leaf_chances = leaf_hits = 0  # first drafts rejected with leaves verified; and of those, leaves kept
        for request, call, tokens, at, (most, _), tried, cached_len, verdict, found in zip(
                batch, calls, proposed, next_best, leaves, verified_leaves, draft_cached_len, verdicts, looked_up):
            if verdict is None:  # its target replica failed this step: it runs again once placed
                continue
            stepped_ks.append(len(tokens))
            before = len(request.history)
            accepted = verdict.accepted
            leaf = [verdict.leaf] if verdict.HasField("leaf") else []
            if tokens and accepted == 0:
                offered = list(at[0].tokens)[:most] if at else []
                if most and len(offered) == most:  # the policy learns where the target's token ranked
                    emitted = leaf[0] if leaf else verdict.next_token
                    first_rejections.append(offered.index(emitted) if emitted in offered else None)
                leaf_chances += bool(tried)
                leaf_hits += len(leaf)
            request.target_len = verdict.cached_len
            if request.features is not None:
                request.features.store(call.keep_len, verdict.features)
            if tokens:
                # What the draft cached past the history is valid as far as its drafts were accepted
                # (a plain draft fed itself its first k-1 proposals; an EAGLE-style one keeps none).
                request.draft_len = min(cached_len, before + accepted)
            request.steps += 1
            request.proposed += len(tokens)
            request.accepted += accepted + len(leaf)
            request.take(tokens[:accepted] + leaf + [verdict.next_token])
            if tokens:  # the chain's: what per-position acceptance counts
                (lookup_outcomes if found else outcomes).append((len(tokens), accepted))
                if found and found[1]:
                    shared_lookup_outcomes.append((len(tokens), accepted))
        self.policy.observe(outcomes)  # the draft's acceptance: a lookup's says nothing of it
        if first_rejections:
            self.policy.observe_first_rejections(first_rejections)
        ended = time.perf_counter()
        if stepped_ks:  # what the step's parts took, for a policy that learns step times
            drafting = [i for i, drafts in enumerate(ready) if drafts is None and proposed[i]]
            self.policy.observe_times(StepTimes(
                len(batch), len(drafting), max((ks[i] for i in drafting), default=0),
                max(len(tokens) + sum(len(group) for group in tried) for tokens, tried in zip(proposed, verified_leaves)),
                1e3 * (drafted - proposing), 1e3 * (verified - drafted), 1e3 * (ended - start)))
        return StepStats(len(stepped_ks), stepped_ks, outcomes, drafted - start, verified - drafted,
                         ended - start, draft_compute, target_compute, leaf_chances, leaf_hits,
                         lookup_outcomes, shared_lookup_outcomes)

    @staticmethod
    def _leaves_to_verify(next_best, verified: int) -> list[list[int]]:
        """The leaves one request's Verify carries (``next_best``: the Proposal's Leaves): the first
        ``verified`` of the draft's next-best tokens at the first position."""
        if not next_best or not verified:
            return []
        return [list(next_best[0].tokens)[:verified]]

    # ---- verify ------------------------------------------------------------------------------------

    def _verify(self, batch: list[Request], calls: list[Call], proposed: list[list[int]],
                proposed_q: list, proposed_leaves: list) -> tuple[list, float]:
        """One Verify per target replica, at once. Verdicts in batch order; None for requests
        whose replica failed (they move) or lost them (they are re-prefilled next step). And the
        target compute seconds (replicas side by side: the slowest one's)."""
        groups = by_target_replica(batch)

        def verify_on(replica: Replica, idx: list[int]):
            group = [batch[i] for i in idx]
            return replica.client.verify(
                [calls[i] for i in idx], [proposed[i] for i in idx], [r.sampling for r in group],
                create=any(r.target_len == 0 for r in group), return_features=bool(self.feature_row_bytes),
                distributions=[proposed_q[i] for i in idx], leaves=[proposed_leaves[i] for i in idx],
                timeout=call_timeout(group, replica.client.timeout)[0])

        results = self.placement.fan_out({replica: (lambda r=replica, i=idx: verify_on(r, i))
                                          for replica, idx in groups.items()})
        verdicts: list = [None] * len(batch)
        compute = 0.0
        for replica, result in results.items():
            idx = groups[replica]
            group = [batch[i] for i in idx]
            if isinstance(result, grpc.RpcError):
                self._verify_failed(replica, group, result)
                continue
            compute = max(compute, result.compute_seconds)  # replicas run side by side
            for i, verdict in zip(idx, result.verdicts):
                verdicts[i] = verdict
        return verdicts, compute

    def _verify_failed(self, replica: Replica, group: list[Request], error: grpc.RpcError) -> None:
        log.warning("verify on %s failed: %s %s", replica.address, error.code().name, error.details())
        if lost_state(error):  # it restarted: rebuild these sequences from history next step
            for request in group:
                request.target_len = 0
        elif unreachable(error):  # the next step moves them to a healthy replica, or they wait
            self.placement.replica_failed(self.placement.target_replicas, replica, group, error)
        else:
            # The service refuses the batch (out of KV memory, say): shed the newest request of
            # it with the service's status so the others can go on.
            newest = max(group, key=lambda r: r.arrival)
            newest.fail(error.code(), f"a model service refused: {error.details()}")

    # ---- propose -----------------------------------------------------------------------------------

    def _propose(self, batch: list[Request], ks: list[int], leaves: list[list[int]],
                 ready: list[list[int] | None]) -> tuple[list[list[int]], list, list, list[int], float]:
        """Draft tokens per request (empty where it does not speculate), the q' each sampled
        request's tokens were drawn from and the leaves proposed beside them (DraftDistribution
        and Leaves messages, passed on to the target as they came), the draft's cached lengths,
        and the draft compute seconds. One Propose per draft replica, at once."""
        proposed: list[list[int]] = [[] for _ in batch]
        proposed_q: list = [() for _ in batch]
        proposed_leaves: list = [() for _ in batch]
        cached_len = [0] * len(batch)
        for i, drafts in enumerate(ready):
            if drafts is not None:  # looked up; the draft holds what it held
                proposed[i], cached_len[i] = drafts, batch[i].draft_len
                if not batch[i].sampling.greedy:  # a point mass
                    proposed_q[i] = [services_pb.DraftDistribution(token_ids=[token], probs=[1.0]) for token in drafts]
        speculating = [i for i, k in enumerate(ks) if k > 0 and ready[i] is None and self._can_draft(batch[i])]
        if not speculating or self.placement.draft_replicas is None:
            return proposed, proposed_q, proposed_leaves, cached_len, 0.0
        groups = by_draft_replica(batch, speculating)
        if None in groups:  # no healthy draft replica for these: target-only, lossless
            groups.pop(None)
            if self.metrics:
                self.metrics.count_draft_fallback()
        results = self.placement.fan_out({replica: (lambda r=replica, i=idx: self._propose_rebuilding(r, batch, i, ks, leaves))
                                          for replica, idx in groups.items()})
        compute = 0.0
        for replica, result in results.items():
            idx = groups[replica]
            if isinstance(result, grpc.RpcError):
                # Lossless without the draft: these run target-only this step.
                log.warning("draft %s unavailable (%s): target-only step", replica.address, result.code().name)
                if unreachable(result):  # down, or slower than its deadline: set aside for a while
                    self.placement.replica_failed(self.placement.draft_replicas, replica, [batch[i] for i in idx],
                                                  result, set_aside_if_slow=True)
                for i in idx:
                    batch[i].draft_len = 0
                continue
            compute = max(compute, result.compute_seconds)
            for i, proposal in zip(idx, result.proposals):
                proposed[i] = list(proposal.tokens)
                proposed_q[i] = proposal.distributions
                proposed_leaves[i] = proposal.leaves
                cached_len[i] = proposal.cached_len
        return proposed, proposed_q, proposed_leaves, cached_len, compute

    def _propose_rebuilding(self, replica: Replica, batch: list[Request], idx: list[int], ks: list[int],
                            leaves: list[list[int]]):
        """Propose; a draft that lost these sequences (it restarted) is rebuilt from history within
        this step, so the step still drafts what it would have: a seeded sampled request's tokens
        depend on which positions were drafted, and stay the same across a draft restart."""
        group = [batch[i] for i in idx]
        for attempt in range(2):
            try:
                return replica.client.propose([self._draft_call(r) for r in group], [ks[i] for i in idx],
                                              [r.sampling for r in group],
                                              timeout=call_timeout(group, replica.client.timeout)[0],
                                              leaves=[leaves[i] for i in idx])
            except grpc.RpcError as error:
                if attempt or not lost_state(error):
                    raise
                for request in group:
                    request.draft_len = 0

    @staticmethod
    def _draft_call(request: Request, start: int | None = None) -> Call:
        """The history from ``start`` (default: what the draft has not cached) with its features."""
        start = request.draft_len if start is None else start
        end = len(request.history)
        features = request.features.for_tokens(start, end) if request.features is not None else b""
        return Call(request.seq_id, start, request.history[start:], features)

    @staticmethod
    def _can_draft(request: Request) -> bool:
        """A draft that reads target features needs them up to the history's second-last token
        (the target has fed everything but the last one)."""
        return request.features is None or request.features.rows >= len(request.history) - 1
