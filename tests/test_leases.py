"""Sequences no coordinator owns any more: a stopping coordinator releases its own, and the model
services reclaim what nobody touched for a lease (a coordinator killed, or one that could not
release). Reclaiming never costs a live request more than a rebuild from its history."""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

from test_engine import FakeClock
from test_exactness import prompts_of_lengths
from tiny import greedy_reference

from specbatch.config.options import parser_for
from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.rpc.client import generate_all, make_request
from specbatch.service.metrics import ServiceMetrics
from specbatch.service.servicer import SequenceLeases
from specbatch.stack.in_process import start_local_stack


def test_sweep_reclaims_on_the_model_thread_counts_and_logs(target_model, caplog):
    clock = FakeClock()
    engine = Engine(target_model, clock=clock)
    metrics = ServiceMetrics("target", engine)
    leases = SequenceLeases(engine, 60.0, metrics)
    engine.prefill([SequenceInput("old", 0, [1, 5, 6]), SequenceInput("older", 0, [1, 7])])
    clock.now += 30
    engine.prefill([SequenceInput("new", 0, [1, 8])])
    threads = []
    original = engine.reclaim_idle
    engine.reclaim_idle = lambda max_idle: threads.append(threading.current_thread().name) or original(max_idle)
    assert leases.sweep() == []
    clock.now += 31
    caplog.set_level(logging.WARNING, logger="specbatch.service.servicer")
    assert sorted(leases.sweep()) == ["old", "older"]
    assert list(engine.sequences) == ["new"]
    assert all(name.startswith("model") for name in threads)  # never beside a forward
    assert metrics.registry.get_sample_value("specbatch_sequences_reclaimed_total") == 2
    assert any("reclaimed 2 sequences" in r.getMessage() for r in caplog.records)


def test_lease_flag():
    parser = parser_for("target")
    assert parser.parse_args([]).sequence_lease_seconds == 300.0
    assert parser.parse_args(["--sequence-lease-seconds", "0"]).sequence_lease_seconds == 0


def test_reclaimed_mid_run_costs_a_rebuild_not_a_request(target_model, draft_model, tokenizer):
    """Every sequence is reclaimed on both services while requests run (as if the lease were
    shorter than a step): the coordinator gets NOT_FOUND and rebuilds them from its history."""
    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8)
    try:
        prompts = prompts_of_lengths([5, 9, 13, 7], seed=41)
        requests = [make_request(p, 100, k=3, ignore_eos=True) for p in prompts]
        target, draft = stack.target_engine, stack.draft_engine
        reclaimed = {}
        # The third target call (a decode step) first reclaims everything on both services.
        calls, original = [0], target.start

        def start(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 3:
                reclaimed["target"] = target.reclaim_idle(-1.0)  # on its model thread already
                reclaimed["draft"] = draft.run(draft.reclaim_idle, -1.0)  # as its sweep runs it
            return original(*args, **kwargs)

        target.start = start
        results = futures.ThreadPoolExecutor(1).submit(generate_all, stack.client(), requests, None, 120).result()
        for prompt, result in zip(prompts, results):
            assert result.token_ids == greedy_reference(target_model, prompt, 100)
        assert reclaimed["target"] and reclaimed["draft"]
        # Each reclaimed sequence was created again from the coordinator's history.
        assert target.sequences_created == len(prompts) + len(reclaimed["target"])
        assert draft.sequences_created == len(prompts) + len(reclaimed["draft"])
    finally:
        stack.stop()


def test_drain_past_its_deadline_releases_every_sequence(target_model, draft_model, tokenizer):
    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8)
    try:
        passed, release = [0], threading.Event()
        original = stack.target_engine.start

        def held_start(*args, **kwargs):  # hold the second target call until the drain gave up
            passed[0] += 1
            if passed[0] == 2:
                release.wait(60)
            return original(*args, **kwargs)

        stack.target_engine.start = held_start
        prompts = prompts_of_lengths([5, 9, 13, 7], seed=43)
        requests = [make_request(p, 100, k=3, ignore_eos=True) for p in prompts]
        running = futures.ThreadPoolExecutor(1).submit(generate_all, stack.client(), requests, None, 120)
        deadline = time.monotonic() + 30
        while passed[0] < 2:
            assert time.monotonic() < deadline, "no decode step"
            time.sleep(0.01)
        assert stack.target_engine.sequences and stack.draft_engine.sequences
        # The drain gives up while the step is held; the step then ends and the loop stops.
        threading.Timer(1.0, release.set).start()
        stack.coordinator.drain(0.2)
        assert not stack.target_engine.sequences and not stack.draft_engine.sequences
        assert running.exception(timeout=30) is not None  # UNAVAILABLE: retry elsewhere
    finally:
        release.set()
        stack.stop()
