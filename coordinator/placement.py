"""Which target and draft replica each request's caches live on: placing requests, moving them
off a replica that failed, releasing their sequences, and calling several replicas at once.

A request keeps its replicas for its life unless one fails; it then moves to a healthy one (or
waits for one) and is re-prefilled there from its history, since its cached length there is 0.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from concurrent import futures

import grpc

from .replicas import Replica, ReplicaSet
from .requests import Request

log = logging.getLogger(__name__)


def log_fields(request: Request) -> dict:
    return {"extra": {"request_id": request.id, "seq_id": request.seq_id}}


def _group(requests: list[Request], replica_of, indices=None) -> dict[Replica | None, list[int]]:
    groups: dict[Replica | None, list[int]] = defaultdict(list)
    for i in range(len(requests)) if indices is None else indices:
        groups[replica_of(requests[i])].append(i)
    return groups


def by_target_replica(requests: list[Request]) -> dict[Replica | None, list[int]]:
    """Indices of ``requests`` grouped by their target replica."""
    return _group(requests, lambda request: request.target_replica)


def by_draft_replica(requests: list[Request], indices=None) -> dict[Replica | None, list[int]]:
    """Indices of ``requests`` (all, or those in ``indices``) grouped by their draft replica
    (None: no healthy draft replica was found for them)."""
    return _group(requests, lambda request: request.draft_replica, indices)


def call_timeout(requests: list[Request], cap: float) -> tuple[float, bool]:
    """The deadline of one call for these requests: the most time any of them has left (the
    call serves them all), at most ``cap``. True when the requests' deadlines set it."""
    now = time.monotonic()
    left = [r.time_left(now) for r in requests]
    if any(t is None for t in left) or max(left) >= cap:
        return cap, False
    return max(max(left), 0.01), True


class Placement:
    """Both replica sets (no draft replicas: None) and the thread pool that calls them at once."""

    def __init__(self, target_replicas: ReplicaSet, draft_replicas: ReplicaSet | None, metrics=None):
        self.target_replicas, self.draft_replicas = target_replicas, draft_replicas
        self.metrics = metrics  # coordinator.metrics.CoordinatorMetrics or None
        # Calls to several replicas (and prefill/release on both services) go out at once.
        self.pool = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="backend")

    def close(self) -> None:
        self.pool.shutdown(wait=False)

    def place(self, request: Request) -> bool:
        """Keep a request on its replicas, or move it off one that is down (its caches are rebuilt
        from history where it lands). False when no target replica is healthy: it waits."""
        if not _usable(request.target_replica):
            request.target_replica = self._move(self.target_replicas, request.target_replica, request)
            request.target_len = 0
        if self.draft_replicas is not None and not _usable(request.draft_replica):
            request.draft_replica = self._move(self.draft_replicas, request.draft_replica, request)
            request.draft_len = 0
        return request.target_replica is not None

    def _move(self, replicas: ReplicaSet, replica: Replica | None, request: Request) -> Replica | None:
        """Detach the request from ``replica`` (down, or None: not placed yet) and attach it to a
        healthy one of ``replicas``, if any."""
        if replica is not None:
            replicas.detach(replica, request.seq_id)
            log.info("moving off %s replica %s", replicas.service, replica.address, **log_fields(request))
            if self.metrics:
                self.metrics.count_failover(replicas.service, 1)
        replica = replicas.pick()
        if replica is not None:
            replicas.attach(replica, request.seq_id)
        return replica

    def release(self, requests: list[Request], timeout: float | None = None) -> None:
        """Free the sequences on every replica that holds them (in parallel) before anything is
        admitted in their place, so that admission never counts memory about to be freed.
        ``timeout``: of each Release call (default: the replica client's own)."""
        held: dict[Replica, list[str]] = defaultdict(list)
        for request in requests:
            for replicas, replica in ((self.target_replicas, request.target_replica),
                                      (self.draft_replicas, request.draft_replica)):
                if replica is not None:
                    replicas.detach(replica, request.seq_id)
                    if replica.healthy:
                        held[replica].append(request.seq_id)
            request.target_replica = request.draft_replica = None
        results = self.fan_out({replica: (lambda r=replica, ids=seq_ids: r.client.release(ids, timeout))
                                for replica, seq_ids in held.items()})
        for replica, result in results.items():
            if isinstance(result, grpc.RpcError):  # released once it answers again (or it restarted)
                log.warning("release on %s failed: %s", replica.address, result.code())
                replica.orphans.update(held[replica])

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


def _usable(replica: Replica | None) -> bool:
    return replica is not None and replica.healthy
