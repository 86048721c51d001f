"""The draft and target services as the scheduler and the decode step see them: one object that
places each request on a replica of each, calls every replica concerned at once, and hides what
a failed call costs. Results come back per request, None where its replica failed.

A request keeps its replicas for its life unless one fails; it then moves to a healthy one (or
waits for one) and is re-prefilled there from its history, since its cached length there is 0.
A service that lost a sequence (it restarted) has it rebuilt from history too: the draft within
the same step, the target at the next one. A draft that fails or is missing leaves its requests
target-only for the step (lossless); a target replica that fails leaves its requests out of the
step (they move and run again next step).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from .backends import Call, lost_state, unreachable
from .chain import Chain
from .replicas import PROBE_TIMEOUT_SECONDS, Replica, ReplicaSet
from .requests import Request, log_fields

log = logging.getLogger(__name__)


def call_timeout(requests: list[Request], cap: float) -> tuple[float, bool]:
    """The deadline of one call for these requests: the most time any of them has left (the
    call serves them all), at most ``cap``. True when the requests' deadlines set it."""
    now = time.monotonic()
    left = [r.time_left(now) for r in requests]
    if any(t is None for t in left) or max(left) >= cap:
        return cap, False
    return max(max(left), 0.01), True


def by_replica(requests: list[Request], service: str, indices=None) -> dict[Replica | None, list[int]]:
    """Indices of ``requests`` (all, or those in ``indices``) grouped by their replica of
    ``service`` ("target" or "draft"; None: no healthy replica was found for them)."""
    groups: dict[Replica | None, list[int]] = defaultdict(list)
    for i in range(len(requests)) if indices is None else indices:
        groups[getattr(requests[i], f"{service}_replica")].append(i)
    return groups


@dataclass
class Prefilled:
    """One round of prefill: per request, the target's verdict on its chunk (None where the call
    failed), and the target calls that failed for a cause the scheduler decides on (a refusal,
    an unreachable replica): (replica, its requests, the error)."""

    verdicts: list
    failed: list[tuple[Replica, list[Request], grpc.RpcError]] = field(default_factory=list)


class Services:
    """Both replica sets (no draft replicas: None) and the thread pool that calls them at once.
    ``reads_features``: the draft reads the target's features, so every Verify returns them and
    the draft caches a prompt at its first Propose (it needs the target's features of it)."""

    def __init__(self, target_replicas: ReplicaSet, draft_replicas: ReplicaSet | None, reads_features: bool = False,
                 metrics=None):
        self.target_replicas, self.draft_replicas = target_replicas, draft_replicas
        self.reads_features = reads_features
        self.metrics = metrics  # coordinator.metrics.CoordinatorMetrics or None
        # Calls to several replicas (and prefill/release on both services) go out at once.
        self.pool = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="backend")
        # The last step's Verify per target replica, wall milliseconds: what a policy per replica
        # prices that replica's steps by (coordinator/policy.py, PerReplica).
        self.verify_ms: dict[Replica, float] = {}
        # The last step's drafting inside its Verify calls per target replica (a draft hosted in its
        # process), compute seconds: the draft's, though no Propose was made.
        self.ahead_compute: dict[Replica, float] = {}
        # The last Verify's further steps per target replica (VerifyResponse.further_steps).
        self.further: dict[Replica, list] = {}

    def close(self) -> None:
        self.pool.shutdown(wait=False)

    # ---- placement ---------------------------------------------------------------------------------

    def place(self, request: Request) -> bool:
        """Keep a request on its replicas, or move it off one that is down (its caches are rebuilt
        from history where it lands), or, where nothing of it is cached yet, off one that has no
        room for it. False when no target replica can take it: it waits."""
        if not _usable(request.target_replica):
            request.target_replica = self._move(self.target_replicas, request.target_replica, request)
            request.target_len = 0
        elif request.target_len == 0 and request.target_replica.crowded is not None:
            request.target_replica = self._elsewhere(self.target_replicas, request.target_replica, request)
        if self.draft_replicas is not None:
            if not _usable(request.draft_replica):
                request.draft_replica = self._move(self.draft_replicas, request.draft_replica, request,
                                                   prefer=request.target_replica and request.target_replica.address)
                request.draft_len = 0
            elif request.draft_len == 0 and request.draft_replica.crowded is not None:  # target-only until room
                request.draft_replica = self._elsewhere(self.draft_replicas, request.draft_replica, request)
        return request.target_replica is not None

    def _elsewhere(self, replicas: ReplicaSet, replica: Replica, request: Request) -> Replica | None:
        """A request with nothing cached on ``replica`` (crowded) goes to one with room, if any."""
        replicas.detach(replica, request.seq_id)
        replica = replicas.pick()
        if replica is not None:
            replicas.attach(replica, request.seq_id)
        return replica

    def out_of_room(self, replicas: ReplicaSet, replica: Replica, ours: int, own: int = 0) -> bool:
        """After ``replica`` refused a call for want of room (RESOURCE_EXHAUSTED): True where what
        it holds can make room once released (``ours`` of its sequences are ours; the others are
        another coordinator's, alive or dead, whose leases end), and it is set crowded until then;
        False where it holds nothing but ``own`` sequences, which wait on the refused call
        themselves: it does not fit beside them, and no wait helps."""
        try:
            stats = replica.client.cache_stats(timeout=PROBE_TIMEOUT_SECONDS)
        except grpc.RpcError:
            stats = None  # cannot tell: wait, and let the watcher look again
        if stats is not None and stats.sequences <= own:
            return False
        replicas.crowd(replica, stats, ours)
        return True

    def _move(self, replicas: ReplicaSet, replica: Replica | None, request: Request,
              prefer: str | None = None) -> Replica | None:
        """Detach the request from ``replica`` (down, or None: not placed yet) and attach it to a
        healthy one of ``replicas`` (the one at ``prefer``, where that is healthy), if any."""
        if replica is not None:
            replicas.detach(replica, request.seq_id)
            log.info("moving off %s replica %s", replicas.service, replica.address, **log_fields(request))
            if self.metrics:
                self.metrics.count_failover(replicas.service, 1)
        replica = replicas.pick(prefer)
        if replica is not None:
            replicas.attach(replica, request.seq_id)
        return replica

    def release(self, requests: list[Request], timeout: float | None = None) -> None:
        """Free the sequences on every replica that holds them (in parallel) before anything is
        admitted in their place, so that admission never counts memory about to be freed.
        ``timeout``: of each Release call (default: the replica client's own)."""
        held: dict[Replica, list[str]] = defaultdict(list)
        sets: dict[Replica, ReplicaSet] = {}
        for request in requests:
            for replicas, replica in ((self.target_replicas, request.target_replica),
                                      (self.draft_replicas, request.draft_replica)):
                if replica is not None:
                    replicas.detach(replica, request.seq_id)
                    if replica.healthy:
                        held[replica].append(request.seq_id)
                        sets[replica] = replicas
            request.target_replica = request.draft_replica = None
        results = self.fan_out({replica: (lambda r=replica, ids=seq_ids: r.client.release(ids, timeout))
                                for replica, seq_ids in held.items()})
        for replica, result in results.items():
            if isinstance(result, grpc.RpcError):  # released once it answers again (or it restarted)
                log.warning("release on %s failed: %s", replica.address, result.code())
                replica.orphans.update(held[replica])
            else:  # room we made ourselves: a new sequence may fit there now
                sets[replica].has_room(replica, f"{len(held[replica])} of our sequences released")

    # ---- the calls of a step -------------------------------------------------------------------------

    def prefill(self, chunks: list[tuple[Request, int]]) -> Prefilled:
        """Feed each request's next ``fed`` prompt tokens to its target, all target replicas at
        once; the draft caches a prompt while the target prefills its last chunk (a draft that
        reads target features needs the target's first: its first Propose does it)."""
        requests = [request for request, _ in chunks]
        calls = [Call(r.seq_id, r.target_len, r.history[r.target_len : r.target_len + fed]) for r, fed in chunks]
        # Groups are fixed before any reply is handled (handling one can detach requests).
        groups = {("target", replica): idx for replica, idx in by_replica(requests, "target").items()}
        finishing = [i for i, call in enumerate(calls) if call.keep_len + len(call.tokens) == len(requests[i].history)]
        if self.draft_replicas is not None and not self.reads_features:
            groups.update({("draft", replica): idx
                           for replica, idx in by_replica(requests, "draft", finishing).items() if replica is not None})

        def prefill(which: str, replica: Replica, idx: list[int]):
            group = [requests[i] for i in idx]
            timeout = call_timeout(group, replica.client.timeout)[0]
            if which == "draft":
                return replica.client.prefill([Call(r.seq_id, 0, r.history) for r in group], timeout)
            return self._verify_on(replica, group, [calls[i] for i in idx], timeout=timeout)

        results = self.fan_out({key: (lambda key=key, idx=idx: prefill(*key, idx)) for key, idx in groups.items()})
        prefilled = Prefilled([None] * len(requests))
        for (which, replica), result in results.items():
            idx = groups[which, replica]
            group = [requests[i] for i in idx]
            if which == "draft":
                self._draft_prefilled(replica, group, result)
            elif not isinstance(result, grpc.RpcError):
                for i, verdict in zip(idx, result.verdicts):
                    prefilled.verdicts[i] = verdict
            elif lost_state(result):  # the target restarted between two chunks: its prompts start again there
                for request in group:
                    request.target_len = 0
                log.warning("prefill on %s lost its sequences (%s): %d prompts start again", replica.address,
                            result.code(), len(group))
            else:
                if unreachable(result):
                    self.replica_failed(self.target_replicas, replica, group, result)
                prefilled.failed.append((replica, group, result))
        return prefilled

    def _draft_prefilled(self, replica: Replica, group: list[Request], result) -> None:
        if isinstance(result, grpc.RpcError):
            log.warning("draft prefill on %s failed (%s): rebuilt at its first Propose", replica.address, result.code())
            if unreachable(result):
                self.replica_failed(self.draft_replicas, replica, group, result)
            return
        for request, seq in zip(group, result.sequences):
            request.draft_len = seq.cached_len

    def propose(self, chains: list[Chain]) -> tuple[list, float]:
        """The draft's Proposal for each chain (asking for its k and its leaves), one Propose per
        draft replica, at once: None where there is no healthy draft or its call failed. And the
        draft's compute seconds (replicas side by side: the slowest one's)."""
        if self.draft_replicas is None:
            return [None] * len(chains), 0.0
        requests = [chain.request for chain in chains]
        groups = by_replica(requests, "draft")
        if groups.pop(None, None) is not None and self.metrics:  # no healthy draft replica for these
            self.metrics.count_draft_fallback()
        return self._each(requests, groups, lambda replica, idx: self._propose_on(replica, [chains[i] for i in idx]),
                          "proposals", self._propose_failed)

    def _propose_on(self, replica: Replica, chains: list[Chain]):
        """Propose; a draft that lost these sequences (it restarted) is rebuilt from history within
        this step, so the step still drafts what it would have: a seeded sampled request's tokens
        depend on which positions were drafted, and stay the same across a draft restart."""
        group = [chain.request for chain in chains]
        for attempt in range(2):
            try:
                return replica.client.propose([_draft_call(r) for r in group], [chain.k for chain in chains],
                                              [r.sampling for r in group],
                                              timeout=call_timeout(group, replica.client.timeout)[0],
                                              leaves=[[chain.leaves] if chain.leaves else [] for chain in chains])
            except grpc.RpcError as error:
                if attempt or not lost_state(error):
                    raise
                for request in group:
                    request.draft_len = 0

    def _propose_failed(self, replica: Replica, group: list[Request], error: grpc.RpcError) -> None:
        log.warning("draft %s unavailable (%s): target-only step", replica.address, error.code().name)
        if unreachable(error):  # down, or slower than its deadline: set aside for a while
            self.replica_failed(self.draft_replicas, replica, group, error, set_aside_if_slow=True)
        elif error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and any(r.draft_len == 0 for r in group):
            # No room there for the new sequences: a refused call changes nothing, so what it holds
            # stays as it was, and the new ones run target-only until it has room.
            self.out_of_room(self.draft_replicas, replica, sum(r.draft_len > 0 for r in group))
            return
        for request in group:
            request.draft_len = 0

    def verify(self, chains: list[Chain], further_steps: int = 0) -> tuple[list, float]:
        """The target's verdict on each chain (its drafts and leaves), one Verify per target
        replica, at once: None where the replica failed (its requests move) or lost them (they are
        re-prefilled next step). And the target's compute seconds (the slowest replica's). With
        ``further_steps``, the chains with ``further`` set may run that many more steps in the
        same call: their verdicts are in ``self.further``, per replica."""
        requests = [chain.request for chain in chains]

        def verify_on(replica: Replica, idx: list[int]):
            group = [chains[i] for i in idx]
            calls = [Call(c.request.seq_id, c.request.target_len, c.request.history[c.request.target_len :])
                     for c in group]
            started = time.perf_counter()
            try:
                reply = self._verify_on(replica, [c.request for c in group], calls, group,
                                        further_steps=further_steps)
                self.ahead_compute[replica] = reply.draft_compute_seconds
                if further_steps:
                    self.further[replica] = list(reply.further_steps)
                return reply
            finally:
                self.verify_ms[replica] = 1e3 * (time.perf_counter() - started)

        self.verify_ms, self.ahead_compute, self.further = {}, {}, {}
        return self._each(requests, by_replica(requests, "target"), verify_on, "verdicts", self._verify_failed)

    def _verify_on(self, replica: Replica, group: list[Request], calls: list[Call], chains: list[Chain] | None = None,
                   timeout: float | None = None, further_steps: int = 0):
        """One Verify of ``calls``: with the chains' drafts and leaves, or without any (a prefill);
        where the draft is hosted in the target's process, with the next step's drafting asked."""
        further = {"further": [c.further for c in chains], "further_steps": further_steps} if further_steps else {}
        return replica.client.verify(
            calls, [c.tokens for c in chains] if chains else [[] for _ in group], [r.sampling for r in group],
            create=any(r.target_len == 0 for r in group), return_features=self.reads_features,
            distributions=[c.distributions for c in chains] if chains else None,
            leaves=[c.leaves_to_verify for c in chains] if chains else None,
            timeout=call_timeout(group, replica.client.timeout)[0] if timeout is None else timeout,
            propose_next=[_propose_next(c) for c in chains] if chains else None, **further)

    def _verify_failed(self, replica: Replica, group: list[Request], error: grpc.RpcError) -> None:
        log.warning("verify on %s failed: %s %s", replica.address, error.code().name, error.details())
        if lost_state(error):  # it restarted: rebuild these sequences from history next step
            for request in group:
                request.target_len = 0
                if hosted_draft(request):  # the draft it hosts restarted with it
                    request.draft_len = 0
        elif unreachable(error):  # the next step moves them to a healthy replica, or they wait
            self.replica_failed(self.target_replicas, replica, group, error)
        elif (error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and any(r.target_len == 0 for r in group)
              and self.out_of_room(self.target_replicas, replica, sum(r.target_len > 0 for r in group))):
            pass  # no room for the sequences it was to rebuild: they go elsewhere, or wait for room
        else:
            # The service refuses the batch (out of KV memory, say): shed the newest request of
            # it with the service's status so the others can go on; it may retry once they are done.
            newest = max(group, key=lambda r: r.arrival)
            newest.fail(error.code(), f"a model service refused: {error.details()}",
                        retry=error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)

    # ---- calling replicas ----------------------------------------------------------------------------

    def _each(self, requests: list[Request], groups: dict[Replica, list[int]], call, items: str,
              failed) -> tuple[list, float]:
        """``call(replica, indices)`` for every group of ``requests`` at once: per request, its entry
        of the reply's ``items`` (None where the call failed, and ``failed(replica, its requests,
        error)`` was told), and the compute seconds of the slowest replica."""
        results = self.fan_out({replica: (lambda r=replica, idx=idx: call(r, idx)) for replica, idx in groups.items()})
        out: list = [None] * len(requests)
        compute = 0.0
        for replica, result in results.items():
            idx = groups[replica]
            if isinstance(result, grpc.RpcError):
                failed(replica, [requests[i] for i in idx], result)
                continue
            compute = max(compute, result.compute_seconds)  # replicas run side by side
            for i, item in zip(idx, getattr(result, items)):
                out[i] = item
        return out, compute

    def fan_out(self, calls: dict) -> dict:
        """Run ``{key: thunk}`` at once (one call inline); ``{key: result or RpcError}``."""

        def attempt(thunk):
            try:
                return thunk()
            except grpc.RpcError as error:
                return error

        if len(calls) == 1:
            return {key: attempt(thunk) for key, thunk in calls.items()}
        jobs = {key: self.pool.submit(attempt, thunk) for key, thunk in calls.items()}
        return {key: job.result() for key, job in jobs.items()}

    def replica_failed(self, replicas: ReplicaSet, replica: Replica, group: list[Request], error: grpc.RpcError,
                       set_aside_if_slow: bool = False) -> None:
        """Mark a replica down after an unreachable error on a call for ``group``, unless the
        requests' own deadline ran out instead (the replica is fine: they are about to be retired).
        ``set_aside_if_slow``: a replica that ran past its own timeout stays down for a cool-down
        that grows with repeats (timeout × 2^failures, at most 30 s)."""
        timeout, client_deadline = call_timeout(group, replica.client.timeout)
        slow = error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        if slow and client_deadline:
            return
        cooldown = min(30.0, timeout * 2 ** replica.failures) if slow and set_aside_if_slow else 0.0
        replicas.mark_down(replica, f"{error.code().name}: {error.details()}", cooldown)


def _draft_call(request: Request, featured: int | None = None) -> Call:
    """What the draft has not cached of the history, with the target's features of it (of its
    tokens before position ``featured`` only, where given: the rest are not computed yet)."""
    start, end = request.draft_len, len(request.history) if featured is None else featured
    features = request.features.for_tokens(start, end) if request.features is not None and start < end else b""
    return Call(request.seq_id, start, request.history[start:], features)


def hosted_draft(request: Request) -> bool:
    """Whether the request's draft is hosted in its target's process (both services on one
    address: python -m target_service --with-draft), so its Verify can draft the next step."""
    draft, target = request.draft_replica, request.target_replica
    return draft is not None and target is not None and draft.healthy and draft.address == target.address


def _propose_next(chain: Chain):
    """(k, leaves, the draft's Call) for a Verify that also drafts the chain's next step: what the
    draft has not cached of the history, with the target's features for those of its tokens at or
    before the target's cached length (the Verify supplies the rest). None: not asked."""
    if not chain.next_k or not hosted_draft(chain.request):
        return None
    return chain.next_k, [chain.leaves] if chain.leaves else [], _draft_call(chain.request,
                                                                            chain.request.target_len + 1)


def _usable(replica: Replica | None) -> bool:
    return replica is not None and replica.healthy
