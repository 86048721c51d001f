"""Continuous batching and the speculative step loop.

One thread owns the running batch. Between steps it retires finished, cancelled and expired
requests and admits waiting ones (prefilling them on their replicas); each step then drafts k
tokens for every sequence that speculates, verifies all sequences (one target call per target
replica), appends what was accepted to each request's authoritative history and streams it out.

Failures cost time, never requests: a sequence on a replica that fails moves to another healthy
replica (or waits for one) and is re-prefilled from its history; with no healthy draft, steps run
target-only (k = 0), which is lossless.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from draft_service.proposer import MAX_K
from specbatch.acceptance import tally_positions

from .backends import Call, lost_state, refusal, unreachable
from .replicas import Replica, ReplicaSet
from .requests import FINISH_CANCELLED, FeatureLog, Request

log = logging.getLogger(__name__)


# How long a stopping coordinator waits for each service to release its sequences: a service
# that does not answer by then reclaims them when their lease runs out.
RELEASE_ON_STOP_SECONDS = 5.0


class QueueFull(Exception):
    pass


class Draining(Exception):
    """The coordinator is shutting down and takes no new requests."""


@dataclass
class StepTotals:
    """Cumulative step timing, for Info and the benchmark."""

    steps: int = 0
    sequence_steps: int = 0  # sum of batch sizes over steps
    step_seconds: float = 0.0  # whole decode steps, as the coordinator sees them
    draft_seconds: float = 0.0  # Propose calls, RPC included
    target_seconds: float = 0.0  # Verify calls, RPC included
    draft_compute_seconds: float = 0.0  # of which the draft service reports computing
    target_compute_seconds: float = 0.0  # of which the target service reports computing
    prefill_seconds: float = 0.0
    # Per draft position: drafts that reached it (every earlier position accepted), and of
    # those, the ones accepted there. Conditional acceptance at i is accepted[i] / reached[i].
    reached_by_position: list[int] = field(default_factory=lambda: [0] * MAX_K)
    accepted_by_position: list[int] = field(default_factory=lambda: [0] * MAX_K)
    k_histogram: list[int] = field(default_factory=lambda: [0] * (MAX_K + 1))  # sequence-steps by k


def log_fields(request: Request) -> dict:
    return {"extra": {"request_id": request.id, "seq_id": request.seq_id}}


def by_replica(requests: list[Request], which: str, indices=None) -> dict[Replica, list[int]]:
    """Indices of ``requests`` (all, or those in ``indices``) grouped by their target or draft
    replica (None: no replica)."""
    groups: dict[Replica, list[int]] = defaultdict(list)
    for i in range(len(requests)) if indices is None else indices:
        groups[getattr(requests[i], f"{which}_replica")].append(i)
    return groups


class Scheduler:
    def __init__(self, targets: ReplicaSet, drafts: ReplicaSet | None, policy, max_batch_size: int,
                 max_queue: int, max_context: int, draft_feature_size: int = 0, metrics=None):
        """Each replica's client timeout is the longest one call to it may take; a draft slower
        than that is set aside for a while (steps run target-only) rather than slowing every step."""
        self.targets, self.drafts = targets, drafts
        # An EAGLE-style draft reads the target's final hidden states: the target returns them
        # with every verdict, and each request keeps them beside its history (float16 rows).
        self.feature_row_bytes = 2 * draft_feature_size if drafts is not None else 0
        self.policy = policy
        self.metrics = metrics  # coordinator metrics (specbatch.metrics.CoordinatorMetrics) or None
        self.max_batch_size, self.max_queue, self.max_context = max_batch_size, max_queue, max_context
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.wakeup = threading.Condition()
        self.stopping = threading.Event()
        self.draining = threading.Event()
        self.totals = StepTotals()
        self.admit_one_at_a_time = False  # after a refused prefill of several requests
        # Calls to several replicas (and prefill/release on both services) go out at once.
        self.pool = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="backend")
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    # ---- called from servicer threads ------------------------------------------------------------

    def submit(self, request: Request) -> None:
        with self.wakeup:
            if self.draining.is_set():
                raise Draining("the coordinator is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting, the queue's limit")
            self.waiting.append(request)
            self.wakeup.notify()

    def load(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def start(self) -> "Scheduler":
        self.thread.start()
        return self

    def drain(self, timeout: float) -> None:
        """Take no new requests; let those held finish within ``timeout`` seconds, then stop.
        Any still unfinished then end with UNAVAILABLE, which tells clients to retry elsewhere."""
        self.draining.set()
        deadline = time.monotonic() + timeout
        while (self.running or self.waiting) and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.05)
        with self.wakeup:
            left = list(self.running) + list(self.waiting)
        for request in left:
            if request.finish is None:
                request.fail(grpc.StatusCode.UNAVAILABLE, "the coordinator is shutting down; retry the request")
        self.stop()

    def stop(self) -> None:
        """Stop stepping; every request still held is closed as cancelled, and its sequences are
        released on the services (those a drain failed included: the loop ends before retiring
        them). What cannot be released now (a service down, or the loop stuck in a call) the
        services reclaim when its lease runs out (--sequence-lease-seconds)."""
        if self.stopping.is_set() and not self.thread.is_alive():
            return  # stopped already (drain stops, then Coordinator.stop stops again)
        self.stopping.set()
        with self.wakeup:
            self.wakeup.notify()
        self.thread.join(timeout=30)
        held = list(self.running) + list(self.waiting)
        for request in held:
            if request.finish is None:
                request.close(FINISH_CANCELLED)
        if self.thread.is_alive():
            log.warning("the step loop did not stop within 30 s: %d requests' sequences are left to the services' "
                        "leases", len(held))
        else:
            self.running = []
            self._release([r for r in held if r.target_replica or r.draft_replica], timeout=RELEASE_ON_STOP_SECONDS)
        self.pool.shutdown(wait=False)

    # ---- the loop --------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self._retire()
                self._admit()
                if self.running:
                    if not self._step():  # no healthy target replica: the batch waits for one
                        self.stopping.wait(0.05)
                else:
                    with self.wakeup:
                        if not self.waiting and not self.stopping.is_set():
                            self.wakeup.wait(timeout=0.5)
            except Exception as error:  # noqa: BLE001 - the loop must survive anything one step does
                log.exception("step failed")
                if self.running:  # bounded damage: the newest request ends, the rest go on
                    self.running[-1].fail(grpc.StatusCode.INTERNAL, f"internal error: {error}")
                self.stopping.wait(0.1)

    # ---- retiring --------------------------------------------------------------------------------

    def _retire(self) -> None:
        now = time.monotonic()
        for request in self.running:
            if request.finish is None and request.deadline is not None and now > request.deadline:
                request.fail(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        done = [r for r in self.running if r.finish is not None or r.cancelled.is_set()]
        if not done:
            return
        for request in done:
            if request.finish is None:
                request.close(FINISH_CANCELLED)
            self._observe_end(request)
        self.running = [r for r in self.running if r.finish is None]
        self._release(done)

    def _observe_end(self, request: Request) -> None:
        if request.failure is not None:
            log.info("request failed: %s %s", request.failure.code.name, request.failure.message, **log_fields(request))
            if self.metrics:
                self.metrics.observe_failed(request.failure.code.name)
            return
        log.debug("request finished: %d tokens in %d steps", request.generated, request.steps, **log_fields(request))
        if self.metrics:
            now = time.monotonic()
            self.metrics.observe_finished(
                request.finish_name(), (request.admitted or now) - request.arrival,
                None if request.first_token is None else request.first_token - request.arrival,
                now - request.arrival, len(request.prompt), request.generated)

    def _release(self, requests: list[Request], timeout: float | None = None) -> None:
        """Free the sequences on every replica that holds them (in parallel) before anything is
        admitted in their place, so that admission never counts memory about to be freed.
        ``timeout``: of each Release call (default: the replica client's own)."""
        held: dict[Replica, list[str]] = defaultdict(list)
        for request in requests:
            for replicas, which in ((self.targets, "target"), (self.drafts, "draft")):
                replica = getattr(request, f"{which}_replica")
                if replica is not None:
                    replicas.detach(replica, request.seq_id)
                    if replica.healthy:
                        held[replica].append(request.seq_id)
                    setattr(request, f"{which}_replica", None)
        results = self._fan_out({replica: (lambda r=replica, ids=seq_ids: r.client.release(ids, timeout))
                                 for replica, seq_ids in held.items()})
        for replica, result in results.items():
            if isinstance(result, grpc.RpcError):  # released once it answers again (or it restarted)
                log.warning("release on %s failed: %s", replica.address, result.code())
                replica.orphans.update(held[replica])

    # ---- placement -------------------------------------------------------------------------------

    def _place(self, request: Request) -> bool:
        """Keep a request on its replicas, or move it off one that is down (its caches are rebuilt
        from history where it lands). False when no target replica is healthy: it waits."""
        for replicas, which in ((self.targets, "target"), (self.drafts, "draft")):
            if replicas is None:
                continue
            replica = getattr(request, f"{which}_replica")
            if replica is not None and replica.healthy:
                continue
            if replica is not None:
                replicas.detach(replica, request.seq_id)
                log.info("moving off %s replica %s", which, replica.address, **log_fields(request))
                if self.metrics:
                    self.metrics.count_failover(which, 1)
            replica = replicas.pick()
            if replica is not None:
                replicas.attach(replica, request.seq_id)
            setattr(request, f"{which}_replica", replica)
            setattr(request, f"{which}_len", 0)
        return request.target_replica is not None

    def _call_timeout(self, requests: list[Request], cap: float) -> tuple[float, bool]:
        """The deadline of one call for these requests: the most time any of them has left (the
        call serves them all), at most ``cap``. True when the requests' deadlines set it."""
        now = time.monotonic()
        left = [r.time_left(now) for r in requests]
        if any(t is None for t in left) or max(left) >= cap:
            return cap, False
        return max(max(left), 0.01), True

    def _fan_out(self, calls: dict) -> dict:
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

    def _replica_failed(self, replicas: ReplicaSet, replica: Replica, group: list[Request], error: grpc.RpcError,
                        set_aside_if_slow: bool = False) -> None:
        """Mark a replica down after an unreachable error on a call for ``group``, unless the
        requests' own deadline ran out instead (the replica is fine: they are about to be retired).
        ``set_aside_if_slow``: a replica that ran past its own timeout stays down for a cool-down
        that grows with repeats (timeout × 2^failures, at most 30 s)."""
        timeout, client_deadline = self._call_timeout(group, replica.client.timeout)
        slow = error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        if slow and client_deadline:
            return
        cooldown = min(30.0, timeout * 2 ** replica.failures) if slow and set_aside_if_slow else 0.0
        replicas.mark_down(replica, f"{error.code().name}: {error.details()}", cooldown)

    # ---- admission -------------------------------------------------------------------------------

    def _admit(self) -> None:
        with self.wakeup:
            if not self.targets.healthy():
                return  # nowhere to prefill: requests wait in the queue
            room = self.max_batch_size - len(self.running)
            if self.admit_one_at_a_time:
                room = min(room, 1)
            admitted, dropped = [], []
            now = time.monotonic()
            while room > 0 and self.waiting:
                request = self.waiting.popleft()
                if request.cancelled.is_set() or (request.deadline is not None and now > request.deadline):
                    dropped.append(request)
                    continue
                admitted.append(request)
                room -= 1
        for request in dropped:
            request.close(FINISH_CANCELLED)
        self._release([r for r in dropped if r.target_replica or r.draft_replica])
        unplaced = [r for r in admitted if not self._place(r)]
        if unplaced:  # every target replica went down just now
            self._requeue(unplaced)
            admitted = [r for r in admitted if r not in unplaced]
        if not admitted:
            return
        start = time.perf_counter()
        for request in admitted:
            request.admitted = request.admitted or time.monotonic()
        # The draft caches the prompt while the target prefills it and picks the first token. A
        # draft that reads target features needs the target's first: its first Propose does it.
        # Groups are fixed before any reply is handled (handling one can detach requests).
        groups = {("target", replica): [admitted[i] for i in idx]
                  for replica, idx in by_replica(admitted, "target").items()}
        if self.drafts is not None and not self.feature_row_bytes:
            groups.update({("draft", replica): [admitted[i] for i in idx]
                           for replica, idx in by_replica(admitted, "draft").items() if replica is not None})

        def prefill(which: str, replica: Replica, group: list[Request]):
            calls = [Call(r.seq_id, 0, r.history) for r in group]
            if which == "draft":
                return replica.client.prefill(calls, self._call_timeout(group, replica.client.timeout)[0])
            return replica.client.verify(calls, [[] for _ in group], [r.sampling for r in group], create=True,
                                         return_features=bool(self.feature_row_bytes),
                                         timeout=self._call_timeout(group, replica.client.timeout)[0])

        results = self._fan_out({key: (lambda key=key, group=group: prefill(*key, group))
                                 for key, group in groups.items()})
        entered = []
        for (which, replica), result in results.items():
            group = groups[which, replica]
            if which == "target":
                if isinstance(result, grpc.RpcError):
                    self._prefill_refused(replica, group, result)
                    continue
                for request, verdict in zip(group, result.verdicts):
                    request.target_len = verdict.cached_len
                    if self.feature_row_bytes:
                        request.features = FeatureLog(self.feature_row_bytes)
                        request.features.store(0, verdict.features)
                    request.take([verdict.next_token])
                    entered.append(request)
            elif isinstance(result, grpc.RpcError):
                log.warning("draft prefill on %s failed (%s): rebuilt at its first Propose", replica.address,
                            result.code())
                if unreachable(result):
                    self._replica_failed(self.drafts, replica, group, result)
            else:
                for request, seq in zip(group, result.sequences):
                    request.draft_len = seq.cached_len
        if entered:
            self.admit_one_at_a_time = False
        self.running.extend(r for r in admitted if r in entered)
        self.totals.prefill_seconds += time.perf_counter() - start

    def _requeue(self, requests: list[Request]) -> None:
        """Back to the head of the queue, in order: retried next round."""
        with self.wakeup:
            self.waiting.extendleft(reversed(requests))

    def _prefill_refused(self, replica: Replica, group: list[Request], error: grpc.RpcError) -> None:
        alone = len(group) == 1
        others_here = any(r.target_replica is replica for r in self.running)
        if refusal(error) and alone and not (error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and others_here):
            group[0].fail(error.code(), f"the target refused the prompt: {error.details()}")
            self._retire_now(group)
            self.admit_one_at_a_time = False
            return
        if unreachable(error):
            self._replica_failed(self.targets, replica, group, error)
        elif refusal(error) and not alone:
            # Out of room while others run (wait for them), or one of several is refused:
            # admit one at a time until the refused one is found.
            self.admit_one_at_a_time = True
        log.warning("prefill on %s failed (%s): %d requests wait", replica.address, error.code(), len(group))
        self._requeue(group)

    def _retire_now(self, requests: list[Request]) -> None:
        for request in requests:
            self._observe_end(request)
        self._release(requests)

    # ---- a decode step -----------------------------------------------------------------------------

    def k_for(self, request: Request, batch_size: int) -> int:
        """The k this request drafts this step: its own fixed k or the policy's, within its limits.
        Greedy and sampled requests alike (sampled ones are verified by rejection sampling)."""
        k = request.fixed_k if request.fixed_k is not None else self.policy.k_for(batch_size)
        # Each step yields accepted + 1 tokens; draft no more than the request can still use.
        k = min(k, request.max_new_tokens - request.generated - 1, self.max_context - len(request.history) - 1, MAX_K)
        return max(k, 0)

    def _step(self) -> bool:
        """One draft → verify → accept step over every request that has a target replica.
        False when none has one (every target replica is down)."""
        batch = [r for r in self.running if r.finish is None and self._place(r)]
        if not batch:
            return False
        start = time.perf_counter()
        ks = [self.k_for(r, len(batch)) for r in batch]
        drafts, draft_q, draft_cached = self._propose(batch, ks)
        drafted = time.perf_counter()
        calls = [Call(r.seq_id, r.target_len, r.history[r.target_len :]) for r in batch]
        verdicts = self._verify(batch, calls, drafts, draft_q)
        verified = time.perf_counter()
        outcomes = []  # (drafted, accepted) of each sequence that drafted: what the policy learns from
        stepped = 0
        for request, call, proposed, cached, verdict in zip(batch, calls, drafts, draft_cached, verdicts):
            if verdict is None:  # its target replica failed this step: it runs again once placed
                continue
            stepped += 1
            before = len(request.history)
            accepted = verdict.accepted
            request.target_len = verdict.cached_len
            if request.features is not None:
                request.features.store(call.keep_len, verdict.features)
            if proposed:
                # What the draft cached past the history is valid as far as its drafts were accepted
                # (a plain draft fed itself its first k-1 proposals; an EAGLE-style one keeps none).
                request.draft_len = min(cached, before + accepted)
            request.steps += 1
            request.proposed += len(proposed)
            request.accepted += accepted
            request.take(proposed[:accepted] + [verdict.next_token])
            if proposed:
                outcomes.append((len(proposed), accepted))
        self.policy.observe(outcomes)
        totals = self.totals
        reached, kept = tally_positions(outcomes, MAX_K)
        for i in range(MAX_K):
            totals.reached_by_position[i] += reached[i]
            totals.accepted_by_position[i] += kept[i]
        used_ks = [len(p) for p, v in zip(drafts, verdicts) if v is not None]
        for k in used_ks:
            totals.k_histogram[k] += 1
        step_seconds = time.perf_counter() - start
        totals.steps += 1
        totals.sequence_steps += stepped
        totals.step_seconds += step_seconds
        totals.draft_seconds += drafted - start
        totals.target_seconds += verified - drafted
        if self.metrics:
            self.metrics.observe_step(stepped, used_ks, outcomes, drafted - start, verified - drafted, step_seconds)
        return True

    def _verify(self, batch: list[Request], calls: list[Call], drafts: list[list[int]], draft_q: list) -> list:
        """One Verify per target replica, at once. Verdicts in batch order; None for requests
        whose replica failed (they move) or lost them (they are re-prefilled next step)."""
        groups = by_replica(batch, "target")

        def verify_on(replica: Replica, idx: list[int]):
            group = [batch[i] for i in idx]
            return replica.client.verify(
                [calls[i] for i in idx], [drafts[i] for i in idx], [r.sampling for r in group],
                create=any(r.target_len == 0 for r in group), return_features=bool(self.feature_row_bytes),
                distributions=[draft_q[i] for i in idx], timeout=self._call_timeout(group, replica.client.timeout)[0])

        results = self._fan_out({replica: (lambda r=replica, i=idx: verify_on(r, i)) for replica, idx in groups.items()})
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
        self.totals.target_compute_seconds += compute
        return verdicts

    def _verify_failed(self, replica: Replica, group: list[Request], error: grpc.RpcError) -> None:
        log.warning("verify on %s failed: %s %s", replica.address, error.code().name, error.details())
        if lost_state(error):  # it restarted: rebuild these sequences from history next step
            for request in group:
                request.target_len = 0
        elif unreachable(error):  # the next step moves them to a healthy replica, or they wait
            self._replica_failed(self.targets, replica, group, error)
        else:
            # The service refuses the batch (out of KV memory, say): shed the newest request of
            # it with the service's status so the others can go on.
            newest = max(group, key=lambda r: r.arrival)
            newest.fail(error.code(), f"a model service refused: {error.details()}")

    def _draft_call(self, request: Request) -> Call:
        start, end = request.draft_len, len(request.history)
        features = request.features.for_tokens(start, end) if request.features is not None else b""
        return Call(request.seq_id, start, request.history[start:], features)

    def _propose(self, batch: list[Request], ks: list[int]) -> tuple[list[list[int]], list, list[int]]:
        """Drafts per request (empty where it does not speculate), the q' each sampled request's
        drafts were drawn from (DraftDistribution messages, passed on to the target as they came),
        and the draft's cached lengths. One Propose per draft replica, at once."""
        drafts: list[list[int]] = [[] for _ in batch]
        draft_q: list = [() for _ in batch]
        cached = [0] * len(batch)
        speculating = [i for i, k in enumerate(ks) if k > 0 and self._can_draft(batch[i])]
        if not speculating or self.drafts is None:
            return drafts, draft_q, cached
        groups = by_replica(batch, "draft", speculating)
        if None in groups:  # no healthy draft replica for these: target-only, lossless
            groups.pop(None)
            if self.metrics:
                self.metrics.count_draft_fallback()
        results = self._fan_out({replica: (lambda r=replica, i=idx: self._propose_rebuilding(r, batch, i, ks))
                                 for replica, idx in groups.items()})
        compute = 0.0
        for replica, result in results.items():
            idx = groups[replica]
            if isinstance(result, grpc.RpcError):
                # Lossless without the draft: these run target-only this step.
                log.warning("draft %s unavailable (%s): target-only step", replica.address, result.code().name)
                if unreachable(result):  # down, or slower than its deadline: set aside for a while
                    self._replica_failed(self.drafts, replica, [batch[i] for i in idx], result, set_aside_if_slow=True)
                for i in idx:
                    batch[i].draft_len = 0
                continue
            compute = max(compute, result.compute_seconds)
            for i, proposal in zip(idx, result.proposals):
                drafts[i] = list(proposal.tokens)
                draft_q[i] = proposal.distributions
                cached[i] = proposal.cached_len
        self.totals.draft_compute_seconds += compute
        return drafts, draft_q, cached

    def _propose_rebuilding(self, replica: Replica, batch: list[Request], idx: list[int], ks: list[int]):
        """Propose; a draft that lost these sequences (it restarted) is rebuilt from history within
        this step, so the step still drafts what it would have: a seeded sampled request's tokens
        depend on which positions were drafted, and stay the same across a draft restart."""
        group = [batch[i] for i in idx]
        for attempt in range(2):
            try:
                return replica.client.propose([self._draft_call(r) for r in group], [ks[i] for i in idx],
                                              [r.sampling for r in group],
                                              timeout=self._call_timeout(group, replica.client.timeout)[0])
            except grpc.RpcError as error:
                if attempt or not lost_state(error):
                    raise
                for request in group:
                    request.draft_len = 0

    def _can_draft(self, request: Request) -> bool:
        """A draft that reads target features needs them up to the history's second-last token
        (the target has fed everything but the last one)."""
        return request.features is None or request.features.rows >= len(request.history) - 1
