"""Continuous batching: the queue and the step loop.

One thread owns the running batch. Between steps it retires finished, cancelled and expired
requests, admits waiting ones and prefills what they hold: whole prompts, or with a prefill chunk
(``prefill_chunk``) at most that many prompt tokens between two decode steps, so that a burst of
prompts, or one long one, does not hold every running sequence's next token for the whole of it.
Each step (coordinator/step.py) then proposes drafts for every sequence that speculates, verifies
all sequences, appends what was accepted to each request's authoritative history and streams it
out. Where each request's caches live, calling the services, and moving requests off a failed
replica, is coordinator/services.py.

Failures cost time, never requests: a sequence on a replica that fails moves to another healthy
replica (or waits for one) and is re-prefilled from its history; with no healthy draft, steps run
target-only (k = 0), which is lossless.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import grpc

from specbatch.config.speculation import SpeculationConfig

from .backends import refusal
from .replicas import Replica, ReplicaSet
from .requests import FINISH_CANCELLED, FeatureLog, Request, log_fields
from .services import Services
from .stats import StepStats, StepTotals
from .step import DecodeStep

log = logging.getLogger(__name__)


# How long a stopping coordinator waits for each service to release its sequences: a service
# that does not answer by then reclaims them when their lease runs out.
RELEASE_ON_STOP_SECONDS = 5.0


class QueueFull(Exception):
    pass


class Draining(Exception):
    """The coordinator is shutting down and takes no new requests."""


class Scheduler:
    def __init__(self, target_replicas: ReplicaSet, draft_replicas: ReplicaSet | None, policy,
                 speculation: SpeculationConfig, max_batch_size: int, max_queue: int, max_context: int,
                 draft_feature_size: int = 0, metrics=None, prefill_chunk: int = 0):
        """``policy``: the k policy (coordinator/policy.py) ``speculation`` names. Each replica's
        client timeout is the longest one call to it may take; a draft slower than that is set aside
        for a while (steps run target-only) rather than slowing every step. ``prefill_chunk``: the
        most prompt tokens prefilled between two decode steps, across the requests being prefilled,
        first come first served (0: every admitted prompt whole, at once)."""
        # An EAGLE-style draft reads the target's final hidden states: the target returns them
        # with every verdict, and each request keeps them beside its history (float16 rows).
        self.feature_row_bytes = 2 * draft_feature_size if draft_replicas is not None else 0
        self.services = Services(target_replicas, draft_replicas, bool(self.feature_row_bytes), metrics)
        self.decode = DecodeStep(self.services, policy, speculation, max_context)
        self.metrics = metrics  # coordinator metrics (coordinator.metrics.CoordinatorMetrics) or None
        self.max_batch_size, self.max_queue, self.max_context = max_batch_size, max_queue, max_context
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        # Admitted and placed, their prompts not yet all on the target: they hold a batch slot.
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        # Guards the queue, and every move of a request between the three lists above: a drain,
        # which looks under it, never finds a request it holds in none of them.
        self.wakeup = threading.Condition()
        self.stopping = threading.Event()
        self.draining = threading.Event()
        self.totals = StepTotals()
        self.admit_one_at_a_time = False  # after a refused prefill of several requests
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    @property
    def policy(self):
        """The k policy (coordinator/policy.py); the profiler swaps it between sweeps."""
        return self.decode.policy

    @policy.setter
    def policy(self, policy) -> None:
        self.decode.policy = policy

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
        """(admitted, waiting): the admitted being prefilled count as running; they hold slots."""
        return len(self.running) + len(self.prefilling), len(self.waiting)

    def start(self) -> "Scheduler":
        self.thread.start()
        return self

    def drain(self, timeout: float) -> None:
        """Take no new requests; let those held finish within ``timeout`` seconds, then stop.
        Any still unfinished then end with UNAVAILABLE, which tells clients to retry elsewhere."""
        self.draining.set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.thread.is_alive():
            with self.wakeup:  # those being prefilled are held too
                if not (self.running or self.prefilling or self.waiting):
                    break
            time.sleep(0.05)
        with self.wakeup:
            left = list(self.running) + list(self.prefilling) + list(self.waiting)
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
        held = list(self.running) + list(self.prefilling) + list(self.waiting)
        for request in held:
            if request.finish is None:
                request.close(FINISH_CANCELLED)
        if self.thread.is_alive():
            log.warning("the step loop did not stop within 30 s: %d requests' sequences are left to the services' "
                        "leases", len(held))
        else:
            self.running, self.prefilling = [], []
            self.services.release([r for r in held if r.target_replica or r.draft_replica],
                                   timeout=RELEASE_ON_STOP_SECONDS)
        self.services.close()

    # ---- the loop --------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self.retire()
                self.admit()
                if self.running:
                    if all(r.finish is not None for r in self.running):
                        continue  # they ended with their prefill's token (one asked, or a stop): retire them
                    if not self.step(self._further_steps()):  # no target replica for any of them: the batch waits
                        self.stopping.wait(0.05)
                elif self.prefilling:
                    if not self.services.target_replicas.healthy():
                        self.stopping.wait(0.05)  # nowhere to prefill: admitted requests wait for a replica
                elif self.waiting and not self.services.target_replicas.open():
                    self.stopping.wait(0.05)  # no replica takes a new sequence: queued requests wait for one
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

    def retire(self) -> None:
        """End what finished, was cancelled or ran past its deadline (running or still being
        prefilled), and release its sequences."""
        now = time.monotonic()
        admitted = self.running + self.prefilling
        for request in admitted:
            if request.finish is None and request.deadline is not None and now > request.deadline:
                request.fail(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        done = [r for r in admitted if r.finish is not None or r.cancelled.is_set()]
        if not done:
            return
        for request in done:
            if request.finish is None:
                request.close(FINISH_CANCELLED)
            self._observe_end(request)
        self.running = [r for r in self.running if r.finish is None]
        self.prefilling = [r for r in self.prefilling if r.finish is None]
        self.services.release(done)

    def _observe_end(self, request: Request) -> None:
        if request.failure is not None:
            log.info("request failed: %s %s", request.failure.code.name, request.failure.message, **log_fields(request))
            if self.metrics:
                self.metrics.observe_failed(request.failure.code.name)
            return
        log.debug("request finished: %d tokens in %d steps", request.generated, request.steps, **log_fields(request))
        self.decode.finished(request)
        if self.metrics:
            now = time.monotonic()
            self.metrics.observe_finished(
                request.finish_name(), (request.admitted or now) - request.arrival,
                None if request.first_token is None else request.first_token - request.arrival,
                now - request.arrival, len(request.prompt), request.generated)

    # ---- admission -------------------------------------------------------------------------------

    def admit(self) -> None:
        """Move waiting requests into the batch as far as there is room, then prefill (a chunk of)
        what the admitted hold; those that cannot be prefilled now wait at the head of the queue.
        Requests cancelled or past their deadline leave the queue whether or not there is room:
        it may be a long wait (another coordinator's sequences hold the target's room)."""
        with self.wakeup:
            now = time.monotonic()
            dropped = [r for r in self.waiting
                       if r.cancelled.is_set() or (r.deadline is not None and now > r.deadline)]
            if dropped:
                gone = {id(r) for r in dropped}
                self.waiting = deque(r for r in self.waiting if id(r) not in gone)
            room = self.max_batch_size - len(self.running) - len(self.prefilling)
            if not self.services.target_replicas.open():
                room = 0  # no replica is up, or none takes a new sequence now: requests wait in the queue
            if self.admit_one_at_a_time:
                room = min(room, 1 - len(self.prefilling))
            admitted, held_back = [], []
            while room > 0 and self.waiting:
                request = self.waiting.popleft()
                replica = request.target_replica
                if request.target_len and replica is not None and replica.crowded is not None:
                    held_back.append(request)  # begun on a replica with no room now: it goes on there later
                    continue
                admitted.append(request)
                room -= 1
            self.waiting.extendleft(reversed(held_back))
            self.prefilling.extend(admitted)
        for request in dropped:
            if request.cancelled.is_set():
                request.close(FINISH_CANCELLED)
            else:  # its deadline passed while it waited: it ends as retire() ends a running one
                request.fail(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed while it waited")
        self.services.release([r for r in dropped if r.target_replica or r.draft_replica])
        for request in admitted:
            request.admitted = request.admitted or time.monotonic()
        if self.prefilling and self.services.target_replicas.healthy():  # else they wait for a replica
            self._prefill()

    def _chunks(self, requests: list[Request]) -> list[tuple[Request, int]]:
        """The prompt tokens each request feeds the target this round, first come first served:
        all it has left, or what the prefill chunk leaves over (the last one fed may stop partway)."""
        budget = self.prefill_chunk or None
        chunks = []
        for request in requests:
            fed = len(request.history) - request.target_len
            if budget is not None:
                fed = min(fed, budget)
                budget -= fed
            chunks.append((request, fed))
            if budget == 0:
                break
        return chunks

    def _prefill(self) -> None:
        """One round of prefill on the admitted requests' replicas, at once: each its chunk of its
        prompt (``_chunks``); those whose whole prompt is now on the target join the running batch
        with their first token."""
        start = time.perf_counter()
        unplaced = [r for r in self.prefilling if not self.services.place(r)]
        if unplaced:  # every target replica went down just now (a move restarts a prompt at 0)
            self._requeue(unplaced)
        chunks = self._chunks(self.prefilling)
        if not chunks:
            return
        prefilled = self.services.prefill(chunks)
        entered = [request for (request, _), verdict in zip(chunks, prefilled.verdicts)
                   if verdict is not None and self._prefilled(request, verdict)]
        for replica, group, error in prefilled.failed:
            self._prefill_refused(replica, group, error)
        if entered:
            self.admit_one_at_a_time = False
            with self.wakeup:
                self.prefilling = [r for r in self.prefilling if r not in entered]
                self.running.extend(entered)
        self.totals.prefill_seconds += time.perf_counter() - start

    def _prefilled(self, request: Request, verdict) -> bool:
        """Take the target's verdict on a chunk of the request's prompt: True when its whole prompt
        is there, and the verdict's token is its first."""
        if self.feature_row_bytes:
            if request.target_len == 0:
                request.features = FeatureLog(self.feature_row_bytes)
            request.features.store(request.target_len, verdict.features)
        request.target_len = verdict.cached_len
        if request.target_len < len(request.history):
            return False
        # (A chunk's before it decided a prompt token: seeded draws go by position, so dropping
        # those changes no later one.)
        request.take([verdict.next_token])
        return True

    def _requeue(self, requests: list[Request]) -> None:
        """From the batch back to the head of the queue, in order: retried next round."""
        with self.wakeup:
            self.prefilling = [r for r in self.prefilling if r not in requests]
            self.waiting.extendleft(reversed(requests))

    def _prefill_refused(self, replica: Replica, group: list[Request], error: grpc.RpcError) -> None:
        """A target call of the prefill failed (its replica unreachable, which the services have
        marked down, or a refusal): the prompts wait, or the one refused alone fails.

        A prompt refused alone for want of room (RESOURCE_EXHAUSTED) waits while the target holds
        other sequences, ours or another coordinator's (a dead one's stay until their lease ends):
        the replica takes no new sequence until some are released. Only a prompt that does not fit
        an empty target is refused, since no wait would help it."""
        with self.wakeup:
            self.prefilling = [r for r in self.prefilling if r not in group]
        alone = len(group) == 1
        if refusal(error) and alone and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            with self.wakeup:
                queued = list(self.waiting)
            here = [r for r in self.running + self.prefilling + queued + group
                    if r.target_replica is replica and r.target_len > 0]
            # Prompts begun there and not finished (this one past its first chunk, say) make no room
            # while they wait: only running requests, or others' sequences, can.
            stuck = sum(r not in self.running for r in here)
            if self.services.out_of_room(self.services.target_replicas, replica, len(here), stuck):
                group[0].refused_alone = 0
            elif group[0].refused_alone == 0:
                group[0].refused_alone = 1  # once more: what held the room may have left just now
            else:
                self._refuse_prompt(group[0], error)
                return
        elif refusal(error) and alone:
            self._refuse_prompt(group[0], error)
            return
        elif refusal(error):
            # One of several is refused (no room for all, or one is bad): admit one at a time
            # until the refused one is found.
            self.admit_one_at_a_time = True
        # Back to the queue; what a prompt has on a healthy target stays there, and it goes on from
        # there once admitted again.
        log.warning("prefill on %s failed (%s): %d requests wait", replica.address, error.code(), len(group))
        self._requeue(group)

    def _refuse_prompt(self, request: Request, error: grpc.RpcError) -> None:
        request.fail(error.code(), f"the target refused the prompt: {error.details()}")
        self._retire_now([request])
        self.admit_one_at_a_time = False

    def _retire_now(self, requests: list[Request]) -> None:
        for request in requests:
            self._observe_end(request)
        self.services.release(requests)

    # ---- a decode step -----------------------------------------------------------------------------

    def step(self, further_steps: int = 0) -> StepStats | None:
        """One propose → verify → accept step over every request that has a target replica, and up
        to ``further_steps`` more in the same Verify where the batch allows them (coordinator/step.py):
        what the first did (every step is counted in the totals and the metrics). None when no
        request has a target replica (every one is down)."""
        batch = [r for r in self.running if r.finish is None and self.services.place(r)]
        if not batch:
            return None
        steps = self.decode.run(batch, further_steps)
        for stats in steps:
            self.totals.add(stats)
            if self.metrics:
                self.metrics.observe_step(stats)
        if self.metrics and self.decode.per_replica:
            self.metrics.set_replica_k(self.decode.policy.chosen)
        return steps[0]

    def _further_steps(self) -> int:
        """The further steps a Verify may run now: none while a request waits for a slot or for its
        prefill (it would wait for all of them), else what --steps-per-call allows."""
        if self.waiting or self.prefilling:
            return 0
        return self.decode.speculation.steps_per_call - 1
