"""The scheduler on its own: queue, placement, one step and failover, over fake replica clients
(no gRPC, no model). The fake target predicts token t+1 after token t; the fake draft proposes
t+1, t+2, … (always right) unless told to be wrong from some position on."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from coordinator.policy import FixedK
from coordinator.replicas import Replica, ReplicaSet
from coordinator.requests import FINISH_LENGTH, Request, TextStream
from coordinator.scheduler import Draining, QueueFull, Scheduler
from coordinator.services import Services, by_replica
from coordinator.stats import StepStats, StepTotals
from specbatch.config.speculation import SpeculationConfig
from specbatch.protocol.sampling_params import SamplingParams

VOCAB = 1000


class Unreachable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "fake replica is down"


class FakeClient:
    def close(self):
        pass


class FakeTarget(FakeClient):
    def __init__(self, address: str):
        self.address, self.timeout = address, 30.0
        self.down = False
        self.calls: list[list] = []
        self.released: list[str] = []

    def verify(self, calls, drafts, sampling, create=False, return_features=False, distributions=(), leaves=(),
               timeout=None, propose_next=None, further=None, further_steps=0):
        if self.down:
            raise Unreachable()
        self.calls.append(calls)
        verdicts = []
        for call, proposed in zip(calls, drafts):
            last = call.tokens[-1]
            accepted = 0
            while accepted < len(proposed) and proposed[accepted] == (last + accepted + 1) % VOCAB:
                accepted += 1
            next_token = (last + accepted + 1) % VOCAB
            verdicts.append(SimpleNamespace(accepted=accepted, next_token=next_token, features=b"",
                                            cached_len=call.keep_len + len(call.tokens) + accepted,
                                            HasField=lambda name: False))  # no leaf kept
        # A target that runs no further steps (they are "up to"): each call is one step.
        return SimpleNamespace(verdicts=verdicts, compute_seconds=0.001, draft_compute_seconds=0.0, further_steps=[])

    def release(self, seq_ids, timeout=None):
        self.released.extend(seq_ids)


class FakeDraft(FakeClient):
    def __init__(self, address: str, wrong_from: int | None = None):
        self.address, self.timeout = address, 10.0
        self.wrong_from = wrong_from  # draft position from which it proposes wrong tokens
        self.down = False
        self.released: list[str] = []

    def prefill(self, calls, timeout=None):
        if self.down:
            raise Unreachable()
        return SimpleNamespace(sequences=[SimpleNamespace(cached_len=c.keep_len + len(c.tokens)) for c in calls])

    def propose(self, calls, ks, sampling, timeout=None, leaves=None):
        if self.down:
            raise Unreachable()
        proposals = []
        for call, k in zip(calls, ks):
            last = call.tokens[-1]
            tokens = [(last + i + 1) % VOCAB if self.wrong_from is None or i < self.wrong_from else 0
                      for i in range(k)]
            proposals.append(SimpleNamespace(tokens=tokens, distributions=(), leaves=(),
                                             cached_len=call.keep_len + len(call.tokens) + k - 1))
        return SimpleNamespace(proposals=proposals, compute_seconds=0.0005)

    def release(self, seq_ids, timeout=None):
        self.released.extend(seq_ids)


class WordTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def replica_set(service: str, *clients) -> ReplicaSet:
    replicas = ReplicaSet(service, ",".join(c.address for c in clients), lambda address: None)
    for client in clients:
        replicas.replicas[client.address] = Replica(service, client.address, client, healthy=True)
    return replicas


def make_request(prompt=(1, 2, 3), max_new_tokens=20, k=None) -> Request:
    return Request(id="r", prompt=list(prompt), max_new_tokens=max_new_tokens, sampling=SamplingParams(),
                   stop_token_ids=frozenset(), text=TextStream(WordTokenizer(), []), fixed_k=k)


@pytest.fixture
def scheduler_of():
    made = []

    def make(targets, drafts=None, k=3, max_batch_size=8, max_queue=8, prefill_chunk=0):
        scheduler = Scheduler(targets, drafts, FixedK(k), SpeculationConfig(k_policy=f"fixed:{k}", prompt_lookup=0),
                              max_batch_size, max_queue, max_context=512, prefill_chunk=prefill_chunk)
        made.append((scheduler, targets, drafts))
        return scheduler

    yield make
    for scheduler, targets, drafts in made:
        scheduler.services.close()
        for replicas in filter(None, (targets, drafts)):
            replicas.close()


def test_admit_then_step_accepts_drafts_and_counts_them_once(scheduler_of):
    target, draft = FakeTarget("t"), FakeDraft("d", wrong_from=2)
    scheduler = scheduler_of(replica_set("target", target), replica_set("draft", draft), k=3)
    request = make_request()
    scheduler.submit(request)
    scheduler.admit()
    assert scheduler.running == [request]
    assert request.history == [1, 2, 3, 4]  # the prefill's verdict gives the first token
    assert (request.target_len, request.draft_len) == (3, 3)

    stats = scheduler.step()
    # Drafts 5, 6 right, the third wrong: two accepted, then the target's 7.
    assert request.history == [1, 2, 3, 4, 5, 6, 7]
    assert isinstance(stats, StepStats)
    assert (stats.batch_size, stats.ks, stats.outcomes) == (1, [3], [(3, 2)])
    assert stats.reached_by_position[:4] == [1, 1, 1, 0]
    assert stats.accepted_by_position[:4] == [1, 1, 0, 0]
    assert request.target_len == 6  # 4 + two accepted drafts; 7 is the next step's first input
    assert request.draft_len == 6  # the draft cached 4 + 5, 6 (its first k-1), valid as far as accepted
    totals = scheduler.totals
    assert (totals.steps, totals.sequence_steps, totals.k_histogram[3]) == (1, 1, 1)
    assert totals.reached_by_position == stats.reached_by_position
    assert totals.accepted_by_position == stats.accepted_by_position


def test_prompts_prefill_in_chunks_between_decode_steps(scheduler_of):
    """With a prefill chunk of 4 tokens, a running request steps between the chunks of two
    prompts of 6 and 5 tokens, which share each round's 4 first come first served; each joins the
    batch, with its first token, only once its whole prompt is on the target, and the draft caches
    a prompt with its last chunk."""
    target, draft = FakeTarget("t"), FakeDraft("d")
    scheduler = scheduler_of(replica_set("target", target), replica_set("draft", draft), k=2, prefill_chunk=4)
    draft_prefills, prefill = [], draft.prefill
    draft.prefill = lambda calls, timeout=None: (draft_prefills.append([(c.keep_len, list(c.tokens)) for c in calls]),
                                                 prefill(calls, timeout))[1]
    running = make_request((1, 2))
    scheduler.submit(running)
    scheduler.admit()
    assert scheduler.running == [running] and running.history == [1, 2, 3]
    first, second = make_request((10, 11, 12, 13, 14, 15)), make_request((20, 21, 22, 23, 24))
    scheduler.submit(first)
    scheduler.submit(second)
    rounds = []
    while scheduler.prefilling or scheduler.waiting:
        target.calls.clear()
        scheduler.admit()
        rounds.append([(call.keep_len, call.tokens) for call in target.calls[0]])
        assert scheduler.load() == (3, 0)  # the ones being prefilled hold their slots
        scheduler.step()
    assert rounds == [[(0, [10, 11, 12, 13])],
                      [(4, [14, 15]), (0, [20, 21])],
                      [(2, [22, 23, 24])]]
    # The running request stepped after every round: 3 steps of 3 tokens each (k = 2, always right).
    assert running.history == list(range(1, 3 + 1 + 9))
    # The first joined after round 2 and stepped twice; the second joined after round 3 and stepped once.
    assert first.history == [10, 11, 12, 13, 14, 15] + list(range(16, 16 + 1 + 6))
    assert second.history == [20, 21, 22, 23, 24] + list(range(25, 25 + 1 + 3))
    assert draft_prefills == [[(0, [1, 2])], [(0, first.prompt)], [(0, second.prompt)]]
    assert scheduler.totals.steps == 3


def test_a_chunked_prompt_whose_target_restarted_starts_again(scheduler_of):
    """A target that lost a half-prefilled prompt (it restarted) answers NOT_FOUND; the prompt
    starts again from its first token on the next round and still gets its first token."""

    class Restarted(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.NOT_FOUND

        def details(self):
            return "unknown sequence"

    target = FakeTarget("t")
    scheduler = scheduler_of(replica_set("target", target), k=0, prefill_chunk=3)
    request = make_request((1, 2, 3, 4, 5))
    scheduler.submit(request)
    scheduler.admit()
    assert request.target_len == 3 and scheduler.prefilling == [request]
    verify = target.verify

    def lost(*args, **kwargs):
        target.verify = verify
        raise Restarted()

    target.verify = lost
    scheduler.admit()
    assert request.target_len == 0 and scheduler.prefilling == [request]
    target.calls.clear()
    scheduler.admit()
    scheduler.admit()
    assert [[(c.keep_len, c.tokens) for c in calls] for calls in target.calls] == [[(0, [1, 2, 3])], [(3, [4, 5])]]
    assert scheduler.running == [request] and request.history == [1, 2, 3, 4, 5, 6]


def test_totals_add_up_step_records():
    totals = StepTotals()
    totals.add(StepStats(2, [3, 0], [(3, 1)], 0.01, 0.02, 0.04, 0.005, 0.015))
    totals.add(StepStats(1, [2], [(2, 2), (0, 0)], 0.01, 0.02, 0.03))
    assert (totals.steps, totals.sequence_steps) == (2, 3)
    assert totals.k_histogram[:4] == [1, 0, 1, 1]
    # (3, 1) reached positions 0 and 1 (a rejection at 1 ends it); (2, 2) reached both and kept both.
    assert totals.reached_by_position[:3] == [2, 2, 0]
    assert totals.accepted_by_position[:3] == [2, 1, 0]
    assert totals.step_seconds == pytest.approx(0.07)
    assert totals.target_compute_seconds == pytest.approx(0.015)


def test_a_failed_draft_makes_the_step_target_only(scheduler_of):
    target, draft = FakeTarget("t"), FakeDraft("d")
    drafts = replica_set("draft", draft)
    scheduler = scheduler_of(replica_set("target", target), drafts, k=3)
    request = make_request()
    scheduler.submit(request)
    scheduler.admit()
    draft.down = True
    stats = scheduler.step()
    assert stats.ks == [0] and stats.outcomes == []
    assert request.history == [1, 2, 3, 4, 5]  # one token, still exact
    assert request.draft_len == 0
    assert not drafts.all()[0].healthy


def test_a_request_moves_off_a_target_replica_that_fails(scheduler_of):
    first, second = FakeTarget("t1"), FakeTarget("t2")
    targets = replica_set("target", first, second)
    scheduler = scheduler_of(targets, None, k=0)
    request = make_request()
    scheduler.submit(request)
    scheduler.admit()
    home = request.target_replica
    home.client.down = True
    stats = scheduler.step()  # its verify fails: it is left out of this step
    assert stats.batch_size == 0 and request.history == [1, 2, 3, 4]
    assert not home.healthy
    scheduler.step()  # placed on the other replica, re-prefilled there from its history
    assert request.target_replica is not home
    assert request.target_replica.client.calls[-1][0].keep_len == 0
    assert request.target_replica.client.calls[-1][0].tokens == [1, 2, 3, 4]
    assert request.history == [1, 2, 3, 4, 5]
    assert request.seq_id in home.orphans  # released once it answers again


def test_no_healthy_target_means_no_step(scheduler_of):
    target = FakeTarget("t")
    targets = replica_set("target", target)
    scheduler = scheduler_of(targets, None)
    request = make_request()
    scheduler.submit(request)
    scheduler.admit()
    targets.all()[0].healthy = False
    assert scheduler.step() is None


@pytest.mark.parametrize("chunk", [0, 2])
def test_the_loop_waits_for_a_target_while_requests_wait_or_are_half_prefilled(scheduler_of, chunk):
    """With every target replica down, a queued request (or one half prefilled) cannot move: the
    loop backs off between rounds instead of spinning on a core."""
    target = FakeTarget("t")
    targets = replica_set("target", target)
    scheduler = scheduler_of(targets, None, prefill_chunk=chunk)
    if chunk:
        scheduler.submit(make_request((1, 2, 3, 4)))
        scheduler.admit()
        assert len(scheduler.prefilling) == 1  # half its prompt on the target
    scheduler.submit(make_request())
    targets.all()[0].healthy = False
    rounds, waits = [], []
    admit = scheduler.admit

    def counted_admit():
        rounds.append(1)
        if len(rounds) > 100:  # spinning: stop the loop rather than hang the test
            scheduler.stopping.set()
        admit()

    def wait(timeout=None):
        waits.append(timeout)
        scheduler.stopping.set()

    scheduler.admit, scheduler.stopping.wait = counted_admit, wait
    scheduler._loop()
    assert (len(rounds), waits) == (1, [0.05])


def test_a_request_that_ends_with_its_prefill_is_retired_without_a_wait(scheduler_of):
    """A request asking one token (or stopped by its first) ends at its prefill: the loop retires
    it and takes the next at once; it waited 50 ms as if no target replica were up."""
    target = FakeTarget("t")
    scheduler = scheduler_of(replica_set("target", target), None)
    request = make_request(max_new_tokens=1)
    scheduler.submit(request)
    rounds, waits = [], []
    admit = scheduler.admit

    def counted_admit():
        rounds.append(1)
        if len(rounds) == 2:
            scheduler.stopping.set()
        admit()

    scheduler.admit, scheduler.stopping.wait = counted_admit, waits.append
    scheduler._loop()
    assert request.finish == FINISH_LENGTH and request.generated == 1
    assert (len(rounds), waits) == (2, []) and target.released == [request.seq_id]


def test_retire_releases_finished_requests_on_both_services(scheduler_of):
    target, draft = FakeTarget("t"), FakeDraft("d")
    scheduler = scheduler_of(replica_set("target", target), replica_set("draft", draft), k=2)
    request = make_request(max_new_tokens=3)
    scheduler.submit(request)
    scheduler.admit()
    scheduler.step()
    assert request.finish is not None  # 1 + 3 tokens reached max_new_tokens
    scheduler.retire()
    assert scheduler.running == []
    assert target.released == [request.seq_id] and draft.released == [request.seq_id]
    assert request.target_replica is None and request.draft_replica is None


def test_queue_limit_and_draining(scheduler_of):
    scheduler = scheduler_of(replica_set("target", FakeTarget("t")), None, max_queue=1)
    scheduler.submit(make_request())
    with pytest.raises(QueueFull):
        scheduler.submit(make_request())
    scheduler.draining.set()
    with pytest.raises(Draining):
        scheduler.submit(make_request())


class GatedTarget(FakeTarget):
    """A target whose first call waits for ``gate``; ``entered`` says the call has begun."""

    def __init__(self, address: str):
        super().__init__(address)
        self.entered, self.gate = threading.Event(), threading.Event()

    def verify(self, *args, **kwargs):
        if not self.entered.is_set():
            self.entered.set()
            assert self.gate.wait(30)
        return super().verify(*args, **kwargs)


def test_a_drain_waits_for_requests_still_being_prefilled(scheduler_of, monkeypatch):
    """Requests admitted together and in their prefill when the drain begins are held too: they
    finish whole. The prefill is let go only once the drain has looked and waited at least once (or
    given up), so the drain cannot have seen them after the prefill."""
    import coordinator.scheduler as scheduler_module

    target = GatedTarget("t")
    scheduler = scheduler_of(replica_set("target", target), None, k=0)
    requests = [make_request(max_new_tokens=5) for _ in range(2)]
    for request in requests:
        scheduler.submit(request)
    scheduler.start()
    assert target.entered.wait(30)
    assert len(scheduler.prefilling) == 2 and not scheduler.running and not scheduler.waiting
    waited = threading.Event()
    sleep = time.sleep
    monkeypatch.setattr(scheduler_module.time, "sleep", lambda seconds: (waited.set(), sleep(seconds)))
    drain = threading.Thread(target=scheduler.drain, args=(30,))
    drain.start()
    deadline = time.monotonic() + 30
    while not waited.is_set() and drain.is_alive():
        assert time.monotonic() < deadline
        sleep(0.01)
    target.gate.set()
    drain.join(60)
    assert not drain.is_alive()
    assert [(r.failure, r.finish) for r in requests] == [(None, FINISH_LENGTH)] * 2


def test_k_is_bounded_by_what_the_request_can_still_use(scheduler_of):
    scheduler = scheduler_of(replica_set("target", FakeTarget("t")), None, k=8)
    request = make_request(max_new_tokens=4)
    assert scheduler.decode.k_for(request, 1) == 3  # each step yields accepted + 1 tokens
    assert scheduler.decode.k_for(make_request(k=2), 1) == 2  # the request's own k wins
    scheduler.policy = FixedK(1)  # the profiler swaps policies between sweeps
    assert scheduler.decode.k_for(make_request(), 1) == 1


def test_placement_groups_requests_by_replica():
    targets = replica_set("target", FakeTarget("t1"), FakeTarget("t2"))
    services = Services(targets, None)
    try:
        requests = [make_request() for _ in range(4)]
        for request in requests:
            assert services.place(request)
        groups = by_replica(requests, "target")
        assert sorted(len(idx) for idx in groups.values()) == [2, 2]  # balanced by load
        assert by_replica(requests, "draft", [0, 2]) == {None: [0, 2]}
    finally:
        services.close()
        targets.close()


def test_a_request_whose_deadline_passed_in_the_queue_fails_with_deadline_exceeded(scheduler_of):
    """As a running request past its deadline does (retire): the client hears DEADLINE_EXCEEDED,
    never a finished stream marked cancelled. A cancelled one is closed as cancelled."""
    import time

    target = FakeTarget("t")
    scheduler = scheduler_of(replica_set("target", target), None)
    late, cancelled = make_request(), make_request()
    late.deadline = time.monotonic() - 1.0
    cancelled.cancelled.set()
    scheduler.submit(late)
    scheduler.submit(cancelled)
    scheduler.admit()
    assert scheduler.running == [] and target.calls == []
    assert late.failure is not None and late.failure.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert cancelled.failure is None and cancelled.finish is not None


class NoRoom(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return "no room"


class FullTarget(FakeTarget):
    """Refuses any call that would hold more than ``room`` sequences, or feed a sequence past
    ``most_tokens``; reports what it holds in CacheStats."""

    def __init__(self, address: str, room: int, most_tokens: int = 10**6):
        super().__init__(address)
        self.room, self.most_tokens = room, most_tokens
        self.held: dict[str, int] = {}

    def verify(self, calls, drafts, sampling, **kwargs):
        held = {**self.held, **{c.seq_id: c.keep_len + len(c.tokens) + len(d) for c, d in zip(calls, drafts)}}
        if len(held) > self.room or max(held.values()) > self.most_tokens:
            raise NoRoom()
        reply = super().verify(calls, drafts, sampling, **kwargs)
        self.held.update({c.seq_id: v.cached_len for c, v in zip(calls, reply.verdicts)})
        return reply

    def release(self, seq_ids, timeout=None):
        super().release(seq_ids)
        for seq_id in seq_ids:
            self.held.pop(seq_id, None)

    def cache_stats(self, timeout=None):
        return SimpleNamespace(sequences=len(self.held), cached_tokens=sum(self.held.values()),
                               max_sequences=self.room)


def test_a_running_request_refused_room_at_a_step_ends_with_a_retry_hint(scheduler_of):
    """A target that cannot hold the batch's next tokens sheds the newest request with its
    RESOURCE_EXHAUSTED, marked for a retry hint; the other goes on."""
    target = FullTarget("t", room=2, most_tokens=12)
    scheduler = scheduler_of(replica_set("target", target), k=0)
    old, new = make_request((1, 2, 3), 20), make_request((5, 6, 7, 8), 20)
    new.arrival = old.arrival + 1
    for request in (old, new):
        scheduler.submit(request)
    scheduler.admit()
    assert scheduler.running == [old, new]
    while new.failure is None:
        scheduler.step()
    assert new.failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED and new.failure.retry
    scheduler.retire()
    scheduler.step()
    assert scheduler.running == [old] and old.failure is None and len(old.history) > 9


def test_a_prompt_refused_room_waits_for_a_running_request_and_one_that_never_fits_is_refused(scheduler_of):
    """One sequence slot: a second prompt waits (the replica takes no new sequence, so no call is
    wasted on it) until the first request is released; a prompt past its first chunk that no
    longer fits a target holding nothing else is refused, not left waiting on itself."""
    target = FullTarget("t", room=1, most_tokens=6)
    scheduler = scheduler_of(replica_set("target", target), k=0, prefill_chunk=3)
    first, second = make_request((1, 2), 2), make_request((5, 6), 2)
    scheduler.submit(first)
    scheduler.admit()
    scheduler.submit(second)
    scheduler.admit()
    (replica,) = scheduler.services.target_replicas.all()
    assert scheduler.running == [first] and list(scheduler.waiting) == [second] and replica.crowded == (1, 2)
    calls = len(target.calls)
    scheduler.admit()
    assert len(target.calls) == calls  # crowded: not asked again
    while scheduler.running:
        scheduler.step()
        scheduler.retire()
    assert first.finish is not None and replica.crowded is None  # our release made room
    scheduler.admit()
    assert scheduler.running == [second]
    while scheduler.running:
        scheduler.step()
        scheduler.retire()
    too_long = make_request(tuple(range(10, 18)), 2)  # 8 tokens: the second chunk passes 6
    scheduler.submit(too_long)
    for _ in range(4):
        scheduler.admit()
    assert too_long.failure is not None and too_long.failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not too_long.failure.retry and not scheduler.waiting and not target.held
