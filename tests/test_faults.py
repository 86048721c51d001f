"""Faults with real processes (forked from ``prefork.Zygote``: the same service code, started
without its 7-8 s of imports): kill -9 the draft mid-run, restart the target mid-run, and 2 target +
2 draft replicas behind one coordinator (affinity, then a target replica stopped mid-run). Eight
concurrent greedy requests each time; every one completes and matches target-only decoding."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from test_exactness import prompts_of_lengths
from tiny import greedy_reference

from specbatch.rpc.client import connect, generate, make_request
from specbatch.rpc.server import wait_until_serving
from specbatch.stack.defaults import free_port
from specbatch.v1 import generation_pb2 as gen_pb
from specbatch.v1 import model_services_pb2 as pb
from specbatch.v1 import model_services_pb2_grpc as pb_grpc

NEW_TOKENS = 100


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, target_model, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-faults")
    target_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


class Processes:
    """Services as child processes, each on its own port; all killed at the end."""

    def __init__(self, folder: str, zygote):
        self.folder, self.zygote = folder, zygote
        self.children: dict[str, subprocess.Popen] = {}

    def spawn(self, name: str, module: str, *flags: str) -> None:
        # Defaults first: a flag given again in ``flags`` wins (argparse keeps the last).
        args = ["--metrics-port", "0", "--log-level", "WARNING", *flags]
        # One thread each: five processes on a small machine, whose OpenMP teams would otherwise
        # spin against each other between calls.
        self.children[name] = self.zygote.start(module, args, {**os.environ, "OMP_NUM_THREADS": "1"})

    def model(self, name: str, kind: str, port: int, *flags: str) -> str:
        layers = ["--num-layers", "2"] if kind == "draft" else []
        self.spawn(name, f"{kind}_service", "--model", self.folder, "--dtype", "float32", "--port", str(port), *layers,
                   *flags)
        return f"127.0.0.1:{port}"

    def coordinator(self, targets: list[str], drafts: list[str], *flags: str) -> str:
        port = free_port()
        self.spawn("coordinator", "coordinator", "--target", ",".join(targets), "--draft", ",".join(drafts),
                   "--tokenizer", self.folder, "--port", str(port), "--max-batch-size", "16",
                   "--draft-timeout", "5", *flags)
        address = f"127.0.0.1:{port}"
        self.wait(address)
        return address

    def wait(self, address: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for name, child in self.children.items():
                assert name.endswith("(dead)") or child.poll() is None, f"{name} exited with {child.returncode}"
            try:
                wait_until_serving(address, timeout=1.0)
                return
            except TimeoutError:
                assert time.monotonic() < deadline, f"{address} is not serving"

    def kill(self, name: str, sig=signal.SIGKILL) -> None:
        child = self.children.pop(name)
        child.send_signal(sig)
        child.wait(30)
        self.children[f"{name} (dead)"] = child

    def stop(self) -> None:
        for child in self.children.values():
            if child.poll() is None:
                child.kill()
                child.wait()


@pytest.fixture
def processes(model_folder, zygote):
    procs = Processes(model_folder, zygote)
    yield procs
    procs.stop()


def start_requests(address: str, prompts: list[list[int]], new_tokens: int = NEW_TOKENS):
    """Eight streams at once; returns futures of their Results once every stream has its first token."""
    stub = connect(address)
    pool = futures.ThreadPoolExecutor(len(prompts))
    started = []

    def run(prompt):
        seen = futures.Future()
        started.append(seen)
        return generate(stub, make_request(prompt, new_tokens, k=3, ignore_eos=True),
                        on_response=lambda r: seen.done() or seen.set_result(True), timeout=300)

    jobs = [pool.submit(run, p) for p in prompts]
    deadline = time.monotonic() + 60
    while len(started) < len(prompts) or not all(s.done() for s in started):
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.005)
    return jobs


def assert_exact(jobs, prompts, target_model, new_tokens: int = NEW_TOKENS) -> list:
    results = [job.result(timeout=300) for job in jobs]
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_reference(target_model, prompt, new_tokens)
    return results


def info(address: str) -> gen_pb.InfoResponse:
    return connect(address).Info(gen_pb.InfoRequest(), timeout=10)


def cache_stats(address: str, kind: str = "target") -> pb.CacheStatsResponse:
    stub = pb_grpc.TargetStub if kind == "target" else pb_grpc.DraftStub
    with grpc.insecure_channel(address) as channel:
        return stub(channel).CacheStats(pb.CacheStatsRequest(), timeout=10)


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_kill_9_draft_mid_run_then_restart_then_target_restarted_mid_run(processes, target_model):
    """Both faults of one draft and one target behind a coordinator, one after the other on the
    same stack (starting a stack of processes costs more than either fault's run)."""
    target_port, draft_port = free_port(), free_port()
    target = processes.model("target", "target", target_port)
    draft = processes.model("draft", "draft", draft_port)
    for address in (target, draft):
        processes.wait(address)
    coordinator = processes.coordinator([target], [draft])

    # kill -9 of the draft mid-run, then a new draft on the same address.
    prompts = prompts_of_lengths([5, 9, 13, 7, 11, 6, 8, 10], seed=31)
    jobs = start_requests(coordinator, prompts)
    processes.kill("draft")  # kill -9, mid-run
    assert_exact(jobs, prompts, target_model)
    assert not next(r for r in info(coordinator).replicas if r.service == "draft").healthy
    # A new draft on the same address: the coordinator's probes find it and speculation resumes.
    processes.model("draft", "draft", draft_port)
    processes.wait(draft)
    wait_for(lambda: next(r for r in info(coordinator).replicas if r.service == "draft").healthy)
    result = generate(connect(coordinator), make_request(prompts[0], 40, k=3, ignore_eos=True), timeout=60)
    assert result.token_ids == greedy_reference(target_model, prompts[0], 40)
    assert result.stats.draft_tokens_proposed > 0

    # The target restarted mid-run: a fresh process on the same address, every cache gone.
    prompts = prompts_of_lengths([5, 9, 13, 7, 11, 6, 8, 10], seed=33)
    jobs = start_requests(coordinator, prompts)
    processes.kill("target")
    processes.model("target", "target", target_port)  # a fresh process: every cache is gone
    assert_exact(jobs, prompts, target_model)  # delay, not errors
    assert cache_stats(target).sequences_created == len(prompts)  # all rebuilt on the new one


def test_two_targets_two_drafts_affinity_and_failover(processes, target_model):
    targets = [processes.model(f"target{i}", "target", free_port()) for i in range(2)]
    drafts = [processes.model(f"draft{i}", "draft", free_port()) for i in range(2)]
    for address in targets + drafts:
        processes.wait(address)
    coordinator = processes.coordinator(targets, drafts)
    prompts = prompts_of_lengths([5, 9, 13, 7, 11, 6, 8, 10], seed=35)
    assert_exact(start_requests(coordinator, prompts), prompts, target_model)
    for kind, replicas in (("target", targets), ("draft", drafts)):
        created = [cache_stats(a, kind).sequences_created for a in replicas]
        assert sum(created) == len(prompts) and min(created) >= 2, created  # each sequence on one, both used
        wait_for(lambda: all(cache_stats(a, kind).sequences == 0 for a in replicas), 10)  # released when done
    # A target replica stops mid-run (SIGTERM: it drains and exits): its sequences move.
    before = cache_stats(targets[0]).sequences_created
    jobs = start_requests(coordinator, prompts)
    processes.kill("target1", signal.SIGTERM)
    assert_exact(jobs, prompts, target_model)
    # Its own half, plus the half that was on the stopped replica and moved here.
    assert cache_stats(targets[0]).sequences_created - before == len(prompts)
    status = {r.address: r for r in info(coordinator).replicas}
    assert not status[targets[1]].healthy and status[targets[0]].healthy


# ---- sequences left behind by a coordinator that stops or dies ------------------------------------

BUDGET = "8"  # --max-sequences of each service: one full batch of the coordinator


def serves_the_full_budget(processes, target: str, draft: str, target_model) -> None:
    """A new coordinator against the same services: a full batch of requests all run, exact."""
    coordinator = processes.coordinator([target], [draft], "--max-batch-size", BUDGET)
    prompts = prompts_of_lengths([5, 9, 13, 7, 11, 6, 8, 10], seed=39)
    assert_exact(start_requests(coordinator, prompts, 30), prompts, target_model, 30)


def test_sigterm_with_a_short_drain_releases_everything(processes, target_model):
    # The default lease (minutes): releasing them is the coordinator's doing.
    target, draft = (processes.model(kind, kind, free_port(), "--max-sequences", BUDGET) for kind in ("target", "draft"))
    for address in (target, draft):
        processes.wait(address)
    coordinator = processes.coordinator([target], [draft], "--max-batch-size", BUDGET, "--drain-seconds", "0.2")
    prompts = prompts_of_lengths([5, 9, 13, 7, 11, 6, 8, 10], seed=37)
    jobs = start_requests(coordinator, prompts, new_tokens=240)  # far more than 0.2 s of work
    assert [cache_stats(a, kind).sequences for a, kind in ((target, "target"), (draft, "draft"))] == [8, 8]
    processes.kill("coordinator", signal.SIGTERM)
    codes = set()
    for job in jobs:
        with pytest.raises(grpc.RpcError) as raised:
            job.result(timeout=60)
        codes.add(raised.value.code())
    assert codes == {grpc.StatusCode.UNAVAILABLE}  # cut by the drain: retry elsewhere
    assert processes.children["coordinator (dead)"].returncode == 0
    assert cache_stats(target).sequences == 0 and cache_stats(draft, "draft").sequences == 0
    serves_the_full_budget(processes, target, draft, target_model)


def reclaimed(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("specbatch_sequences_reclaimed_total "))


def test_kill_9_of_the_coordinator_costs_memory_for_a_lease_only(processes, target_model):
    ports = {kind: free_port() for kind in ("target", "draft")}
    target = processes.model("target", "target", free_port(), "--max-sequences", BUDGET,
                             "--sequence-lease-seconds", "3", "--metrics-port", str(ports["target"]))
    draft = processes.model("draft", "draft", free_port(), "--max-sequences", BUDGET,
                            "--sequence-lease-seconds", "3", "--metrics-port", str(ports["draft"]))
    for address in (target, draft):
        processes.wait(address)
    coordinator = processes.coordinator([target], [draft], "--max-batch-size", BUDGET)
    prompts = prompts_of_lengths([5, 9, 13, 7, 11, 6, 8, 10], seed=38)
    jobs = start_requests(coordinator, prompts, new_tokens=240)
    assert [cache_stats(target).sequences, cache_stats(draft, "draft").sequences] == [8, 8]
    processes.kill("coordinator")  # kill -9: nothing is released
    for job in jobs:
        with pytest.raises(grpc.RpcError):
            job.result(timeout=60)
    # Reclaimed once untouched for the lease (3 s; swept every 0.75 s): all 8 on each, none
    # released (nobody was left to release them).
    wait_for(lambda: cache_stats(target).sequences == 0 and cache_stats(draft, "draft").sequences == 0, 30)
    assert [reclaimed(ports["target"]), reclaimed(ports["draft"])] == [8, 8]
    serves_the_full_budget(processes, target, draft, target_model)
