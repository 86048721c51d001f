"""Continuous batching and the speculative step loop.

One thread owns the running batch. Between steps it retires finished and cancelled requests and
admits waiting ones (prefilling them on both services); each step then drafts k tokens for every
sequence that speculates, verifies all sequences in one target call, appends what was accepted to
each request's authoritative history and streams it out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from draft_service.proposer import MAX_K

from .backends import Call, DraftClient, TargetClient, lost_state, refusal
from .policy import tally_positions
from .requests import FINISH_CANCELLED, FeatureLog, Request

log = logging.getLogger(__name__)


class QueueFull(Exception):
    pass


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


class Scheduler:
    def __init__(self, target: TargetClient, draft: DraftClient | None, policy, max_batch_size: int,
                 max_queue: int, max_context: int, draft_feature_size: int = 0):
        self.target, self.draft = target, draft
        # An EAGLE-style draft reads the target's final hidden states: the target returns them
        # with every verdict, and each request keeps them beside its history (float16 rows).
        self.feature_row_bytes = 2 * draft_feature_size if draft is not None else 0
        self.policy = policy
        self.max_batch_size, self.max_queue, self.max_context = max_batch_size, max_queue, max_context
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.wakeup = threading.Condition()
        self.stopping = threading.Event()
        self.totals = StepTotals()
        self.admit_one_at_a_time = False  # after a refused prefill of several requests
        # Prefill and release go to both services at once.
        self.pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="backend")
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    # ---- called from servicer threads ------------------------------------------------------------

    def submit(self, request: Request) -> None:
        with self.wakeup:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting, the queue's limit")
            self.waiting.append(request)
            self.wakeup.notify()

    def load(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def start(self) -> "Scheduler":
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop stepping; every request still held is closed as cancelled."""
        self.stopping.set()
        with self.wakeup:
            self.wakeup.notify()
        self.thread.join(timeout=30)
        for request in list(self.running) + list(self.waiting):
            if request.finish is None:
                request.close(FINISH_CANCELLED)
        self.pool.shutdown(wait=False)

    # ---- the loop --------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self._retire()
                self._admit()
                if self.running:
                    self._step()
                else:
                    with self.wakeup:
                        if not self.waiting and not self.stopping.is_set():
                            self.wakeup.wait(timeout=1.0)
            except grpc.RpcError as error:
                log.warning("step failed: %s %s", error.code(), error.details())
                if refusal(error) and self.running:
                    # The service refuses the batch (out of KV memory, say): shed the newest
                    # request with the service's status so the others can go on.
                    self.running[-1].fail(error.code(), f"a model service refused: {error.details()}")
                    continue
                # A service down past the retries: requests wait (time, not errors), and state it
                # lost is rebuilt from history once it is back.
                if lost_state(error):
                    self._forget_service_state()
                self.stopping.wait(0.5)
            except Exception as error:  # noqa: BLE001 - the loop must survive anything one step does
                log.exception("step failed")
                if self.running:  # bounded damage: the newest request ends, the rest go on
                    self.running[-1].fail(grpc.StatusCode.INTERNAL, f"internal error: {error}")
                self.stopping.wait(0.1)

    def _forget_service_state(self) -> None:
        for request in self.running:
            request.target_len = request.draft_len = 0

    def _retire(self) -> None:
        done = [r for r in self.running if r.finish is not None or r.cancelled.is_set()]
        if not done:
            return
        for request in done:
            if request.finish is None:
                request.close(FINISH_CANCELLED)
        self.running = [r for r in self.running if r not in done]
        self._release([r.seq_id for r in done])

    def _release(self, seq_ids: list[str]) -> None:
        """Free the sequences on both services (in parallel) before anything is admitted in
        their place, so that admission never counts memory that is about to be freed."""
        jobs = [self.pool.submit(client.release, seq_ids) for client in filter(None, (self.target, self.draft))]
        for job in jobs:
            try:
                job.result()
            except grpc.RpcError as error:  # a service that is down frees its memory anyway
                log.warning("release failed: %s", error.code())

    def _admit(self) -> None:
        with self.wakeup:
            room = self.max_batch_size - len(self.running)
            if self.admit_one_at_a_time:
                room = min(room, 1)
            admitted = []
            while room > 0 and self.waiting:
                request = self.waiting.popleft()
                if request.cancelled.is_set():
                    request.close(FINISH_CANCELLED)
                    continue
                admitted.append(request)
                room -= 1
        if not admitted:
            return
        start = time.perf_counter()
        now = time.monotonic()
        for request in admitted:
            request.admitted = now
        prefill_calls = [Call(r.seq_id, 0, r.history) for r in admitted]
        # The draft caches the prompt while the target prefills it and picks the first token. A
        # draft that reads target features needs the target's first: its first Propose does it.
        draft_job = None
        if self.draft and not self.feature_row_bytes:
            draft_job = self.pool.submit(self.draft.prefill, prefill_calls)
        try:
            verdicts = self.target.verify(prefill_calls, [[] for _ in admitted], [r.sampling for r in admitted],
                                          create=True, return_features=bool(self.feature_row_bytes)).verdicts
        except grpc.RpcError as error:
            alone = len(admitted) == 1
            if refusal(error) and alone and not (error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and self.running):
                admitted[0].fail(error.code(), f"the target refused the prompt: {error.details()}")
                self.admit_one_at_a_time = False
                return
            with self.wakeup:  # back to the head of the queue, in order: retried next round
                self.waiting.extendleft(reversed(admitted))
            if refusal(error):
                # Out of room while others run (wait for them), or one of several is refused:
                # admit one at a time until the refused one is found.
                if not alone:
                    self.admit_one_at_a_time = True
                return
            raise
        self.admit_one_at_a_time = False
        for request, verdict in zip(admitted, verdicts):
            request.target_len = verdict.cached_len
            if self.feature_row_bytes:
                request.features = FeatureLog(self.feature_row_bytes)
                request.features.store(0, verdict.features)
            request.take([verdict.next_token])
        if draft_job is not None:
            try:
                for request, seq in zip(admitted, draft_job.result().sequences):
                    request.draft_len = seq.cached_len
            except grpc.RpcError as error:
                log.warning("draft prefill failed (%s); these sequences start without speculation", error.code())
        self.running.extend(admitted)
        self.totals.prefill_seconds += time.perf_counter() - start

    def k_for(self, request: Request, batch_size: int) -> int:
        """The k this request drafts this step: its own fixed k or the policy's, within its limits.
        Greedy and sampled requests alike (sampled ones are verified by rejection sampling)."""
        k = request.fixed_k if request.fixed_k is not None else self.policy.k_for(batch_size)
        # Each step yields accepted + 1 tokens; draft no more than the request can still use.
        k = min(k, request.max_new_tokens - request.generated - 1, self.max_context - len(request.history) - 1, MAX_K)
        return max(k, 0)

    def _step(self) -> None:
        batch = [r for r in self.running if r.finish is None]
        if not batch:
            return
        start = time.perf_counter()
        ks = [self.k_for(r, len(batch)) for r in batch]
        drafts, draft_q, draft_cached = self._propose(batch, ks)
        drafted = time.perf_counter()
        calls = [Call(r.seq_id, r.target_len, r.history[r.target_len :]) for r in batch]
        reply = self.target.verify(calls, drafts, [r.sampling for r in batch],
                                   create=any(r.target_len == 0 for r in batch),
                                   return_features=bool(self.feature_row_bytes), distributions=draft_q)
        verdicts = reply.verdicts
        verified = time.perf_counter()
        outcomes = []  # (drafted, accepted) of each sequence that drafted: what the policy learns from
        for request, call, proposed, cached, verdict in zip(batch, calls, drafts, draft_cached, verdicts):
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
        for proposed in drafts:
            totals.k_histogram[len(proposed)] += 1
        totals.steps += 1
        totals.sequence_steps += len(batch)
        totals.step_seconds += time.perf_counter() - start
        totals.draft_seconds += drafted - start
        totals.target_seconds += verified - drafted
        totals.target_compute_seconds += reply.compute_seconds

    def _draft_call(self, request: Request) -> Call:
        start, end = request.draft_len, len(request.history)
        features = request.features.for_tokens(start, end) if request.features is not None else b""
        return Call(request.seq_id, start, request.history[start:], features)

    def _propose(self, batch: list[Request], ks: list[int]) -> tuple[list[list[int]], list, list[int]]:
        """Drafts per request (empty where it does not speculate), the q' each sampled request's
        drafts were drawn from (DraftDistribution messages, passed on to the target as they came),
        and the draft's cached lengths."""
        drafts: list[list[int]] = [[] for _ in batch]
        draft_q: list = [() for _ in batch]
        cached = [0] * len(batch)
        speculating = [i for i, k in enumerate(ks) if k > 0 and self._can_draft(batch[i])]
        if not speculating or self.draft is None:
            return drafts, draft_q, cached
        try:
            reply = self._propose_rebuilding(batch, speculating, ks)
        except grpc.RpcError as error:
            # Lossless without the draft: this step runs target-only, and the draft's caches are
            # rebuilt from history on the next call that reaches it.
            log.warning("draft unavailable (%s): target-only step", error.code())
            for i in speculating:
                batch[i].draft_len = 0
            return drafts, draft_q, cached
        self.totals.draft_compute_seconds += reply.compute_seconds
        for i, proposal in zip(speculating, reply.proposals):
            drafts[i] = list(proposal.tokens)
            draft_q[i] = proposal.distributions
            cached[i] = proposal.cached_len
        return drafts, draft_q, cached

    def _propose_rebuilding(self, batch: list[Request], speculating: list[int], ks: list[int]):
        """Propose; a draft that lost these sequences (it restarted) is rebuilt from history within
        this step, so the step still drafts what it would have: a seeded sampled request's tokens
        depend on which positions were drafted, and stay the same across a draft restart."""
        for attempt in range(2):
            calls = [self._draft_call(batch[i]) for i in speculating]
            try:
                return self.draft.propose(calls, [ks[i] for i in speculating], [batch[i].sampling for i in speculating])
            except grpc.RpcError as error:
                if attempt or not lost_state(error):
                    raise
                for i in speculating:
                    batch[i].draft_len = 0

    def _can_draft(self, request: Request) -> bool:
        """A draft that reads target features needs them up to the history's second-last token
        (the target has fed everything but the last one)."""
        return request.features is None or request.features.rows >= len(request.history) - 1

