"""Benchmark traffic (specbatch/commands/bench/traffic.py) and ``specbatch bench`` comparing every mode in one run."""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from pathlib import Path

import pytest
from test_profile import gpu_like, synthetic_profile

from coordinator.app import build_coordinator
from specbatch.commands import cli
from specbatch.commands.bench.report import percentiles
from specbatch.commands.bench.run import coordinator_policies
from specbatch.commands.bench.traffic import (
    DEFAULT_TRACE,
    Record,
    Trace,
    poisson_arrivals,
    prompt_order,
    run_closed_loop,
)
from specbatch.config.speculation import SpeculationConfig


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    a = poisson_arrivals(2.0, 2000, seed=1)
    assert a == poisson_arrivals(2.0, 2000, seed=1)
    assert a != poisson_arrivals(2.0, 2000, seed=2)
    assert a == sorted(a) and a[0] > 0
    gaps = [y - x for x, y in zip([0.0] + a, a)]
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.1)
    assert statistics.pstdev(gaps) == pytest.approx(0.5, rel=0.15)  # exponential: sd = mean


def test_prompt_order_is_a_seeded_shuffle():
    order = prompt_order(10, 4, seed=3)
    assert order == prompt_order(10, 4, seed=3) and order != prompt_order(10, 4, seed=4)
    assert sorted(order[:4]) == [0, 1, 2, 3] and sorted(order[4:8]) == [0, 1, 2, 3]


def test_the_shipped_trace():
    trace = Trace.load(DEFAULT_TRACE)
    levels = [c for _, c in trace.segments]
    assert min(levels) == 1 and max(levels) == 32 and trace.peak == 32
    assert trace.concurrency_at(0) == 1 and trace.concurrency_at(trace.duration + 1) == 0
    fast = trace.scaled(10)
    assert fast.duration == pytest.approx(trace.duration / 10)
    assert [fast.concurrency_at(t / 10) for t in range(0, int(trace.duration), 7)] == \
        [trace.concurrency_at(t) for t in range(0, int(trace.duration), 7)]


def test_bad_traces_are_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"segments": [{"seconds": 1, "concurrency": 0}]}))
    with pytest.raises(ValueError, match="concurrency >= 1"):
        Trace.load(path)


def _fake_send(hold: float, log: list, lock: threading.Lock, in_flight: list):
    def send(i):
        with lock:
            in_flight[0] += 1
            log.append((time.monotonic(), in_flight[0]))
        time.sleep(hold)
        with lock:
            in_flight[0] -= 1
        r = Record(i, time.monotonic() - hold)
        r.first_token = r.finished = time.monotonic()
        return r

    return send


def test_closed_loop_follows_the_trace():
    trace = Trace("t", ((0.4, 1), (0.4, 4), (0.4, 2)))
    log, lock, in_flight = [], threading.Lock(), [0]
    start = time.monotonic()
    records = run_closed_loop(_fake_send(0.05, log, lock, in_flight), trace.concurrency_at, duration=trace.duration)
    elapsed = time.monotonic() - start
    assert trace.duration <= elapsed < trace.duration + 0.5
    assert [r.index for r in records] == list(range(len(records)))
    for at, n in log:  # never more in flight than the trace allows when a request starts
        assert n <= max(trace.concurrency_at(at - start - 0.02), trace.concurrency_at(at - start))
    peak = max(n for at, n in log if 0.45 < at - start < 0.75)
    assert peak == 4  # and the trace's concurrency is reached
    assert max(n for at, n in log if at - start < 0.35) == 1


def test_uniform_closed_loop_sends_count_at_concurrency():
    log, lock, in_flight = [], threading.Lock(), [0]
    records = run_closed_loop(_fake_send(0.02, log, lock, in_flight), lambda t: 3, count=10)
    assert len(records) == 10 and max(n for _, n in log) == 3


def test_open_loop_sends_on_schedule(monkeypatch):
    """On a fake clock that only the loop's own sleeps move: each request is sent at its arrival
    time, and none waits for the ones before it (all four are in flight at once)."""
    import types

    import specbatch.commands.bench.traffic as traffic

    arrivals = [0.0, 0.1, 0.1, 0.3]
    clock, started, lock = [0.0], [], threading.Lock()
    everyone = threading.Event()

    def sleep(seconds):
        # Every request due by now has started (read the clock) before the clock moves on.
        due = sum(at <= clock[0] + 1e-9 for at in arrivals)
        deadline = time.monotonic() + 10
        while len(started) < due and time.monotonic() < deadline:
            time.sleep(0.001)
        clock[0] += seconds

    monkeypatch.setattr(traffic, "time", types.SimpleNamespace(monotonic=lambda: clock[0], sleep=sleep))

    def send(i):
        with lock:
            started.append(clock[0])
            if len(started) == len(arrivals):
                everyone.set()
        held_together = everyone.wait(10)  # a loop that waited for earlier requests never gets here
        r = Record(i, 0.0)
        r.first_token = r.finished = 0.0
        r.error = "" if held_together else "not all in flight at once"
        return r

    records = traffic.run_open_loop(send, arrivals)
    assert sorted(started) == pytest.approx(arrivals)
    assert [r.error for r in records] == [""] * len(arrivals)


def test_percentiles():
    stats = percentiles([1.0, 2.0, 3.0, 4.0, 100.0])
    assert stats["mean"] == 22.0 and stats["p50"] == 3.0 and stats["p99"] == pytest.approx(96.16)


def policy_coordinators(stack, tokenizer, tmp_path, policies: tuple[str, ...]) -> dict:
    """One coordinator per policy over the stack's services, on a synthetic profile where
    drafting pays at batch 1-8."""
    profile = tmp_path / "profile.json"
    synthetic_profile(gpu_like, [0.9, 0.85, 0.8, 0.75], sizes=(1, 2, 4, 8)).save(profile)
    services = (f"127.0.0.1:{stack.target.port}", f"127.0.0.1:{stack.draft.port}")
    return {p: build_coordinator(*services, tokenizer, max_batch_size=8, speculation=SpeculationConfig(k_policy=p, profile=str(profile)))
            for p in policies}


def bench_with_policies(stack, coordinators: dict, *flags: str) -> int:
    """``specbatch bench`` against the stack's coordinator and these policy coordinators, which it
    stops afterwards."""
    try:
        return cli.main(["bench", "--address", stack.address, "--policies", ",".join(coordinators),
                         *[f"--policy-address={p}=127.0.0.1:{c.port}" for p, c in coordinators.items()], *flags])
    finally:
        for coordinator in coordinators.values():
            coordinator.stop(grace=1)


def test_bench_compares_every_mode_under_every_traffic(stack, tokenizer, tmp_path, capsys):
    adaptive = policy_coordinators(stack, tokenizer, tmp_path, ("profile", "goodput"))
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"name": "tiny", "segments": [{"seconds": 0.4, "concurrency": 1},
                                                              {"seconds": 0.4, "concurrency": 3}]}))
    out = tmp_path / "out"
    code = bench_with_policies(stack, adaptive, "--fixed-k", "1,2", "--traffic", "uniform,trace,poisson",
                               "--concurrency", "1,3", "--requests", "3", "--trace", str(trace), "--rates", "20",
                               "--poisson-requests", "3", "--max-new-tokens", "6", "--prompts", "chat", "--out", str(out))
    assert code == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    modes = ["k=0 (target only)", "k=1", "k=2", "profile", "goodput"]
    loads = ["uniform c=1", "uniform c=3", "trace tiny", "poisson 20/s"]
    assert [(r["load"], r["mode"]) for r in rows] == [(load, mode) for load in loads for mode in modes]
    for r in rows:
        assert r["requests"] > 0 and not r["errors"] and r["tokens_per_s"] > 0
        assert r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        assert r["latency_s"]["mean"] > 0
        if r["mode"] == "k=0 (target only)":
            assert r["mean_k"] == 0 and r["acceptance"] is None
        if r["mode"] == "k=2":
            assert 0 < r["mean_k"] <= 2
        if r["mode"] in ("profile", "goodput"):
            assert r["mean_k"] > 0  # the synthetic profile says drafting pays at these batch sizes
    assert sum(r["requests"] for r in rows if r["load"] == "uniform c=3") == 3 * 5
    for name in ("results.md", "uniform.png", "poisson.png", "trace.png"):
        assert (out / name).exists(), name
    assert (out / "trace.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "| trace tiny | goodput |" in printed and "| poisson 20/s | profile |" in printed


def test_bench_needs_a_profile_for_the_policies(capsys):
    assert cli.main(["bench", "--policies", "goodput", "--target-model", "a-model-without-a-shipped-profile"]) == 2
    assert "need --profile" in capsys.readouterr().out


def test_two_profiles_can_be_served_side_by_side(capsys):
    """goodput@new is policy goodput, a mode of its own, on the profile given for it; a profile for
    a policy that is not compared is refused."""
    assert coordinator_policies(["profile", "goodput", "goodput@new"], ["goodput@new=new.json"], "old.json") == {
        "profile": ("profile", "old.json"), "goodput": ("goodput", "old.json"), "goodput@new": ("goodput", "new.json")}
    # learn would start from a profile it is given: only from its own, never the stack's
    assert coordinator_policies(["learn", "learn@seeded"], ["learn@seeded=new.json"], "old.json") == {
        "learn": ("learn", None), "learn@seeded": ("learn", "new.json")}
    assert cli.main(["bench", "--policies", "goodput", "--profile", "p.json", "--policy-profile", "profile=x.json"]) == 2
    assert "--policy-profile takes POLICY=PATH for a policy in --policies" in capsys.readouterr().out


def test_bench_refuses_a_shared_lookup_index(capsys):
    """Its modes and rounds send the same prompts: a shared index would draft from their own answers."""
    assert cli.main(["bench", "--shared-lookup", "1000", "--policies", ""]) == 2
    assert "--shared-lookup" in capsys.readouterr().out


def test_rounds_sum_each_modes_runs_with_the_modes_taking_turns(stack, tmp_path, monkeypatch):
    """--rounds 3: each level runs every mode three times, the order rotated each round and each
    round on its own prompts (seed + round); a row sums its rounds."""
    from specbatch.commands.bench import run as bench

    calls = []
    real_run_one = bench.run_one

    def recording(load, mode, prompts, args, round_=0):
        calls.append((load.label, mode.name, round_))
        return real_run_one(load, mode, prompts, args, round_)

    monkeypatch.setattr(bench, "run_one", recording)
    out = tmp_path / "out"
    code = cli.main(["bench", "--address", stack.address, "--fixed-k", "1,2", "--traffic", "uniform",
                     "--concurrency", "1", "--requests", "2", "--rounds", "3", "--max-new-tokens", "5",
                     "--prompts", "chat", "--control", "--out", str(out)])
    assert code == 0
    modes = ["k=0 (target only)", "k=1", "k=2", "k=0 (control)"]
    assert [(mode, r) for _, mode, r in calls] == [(m, r) for r in range(3) for m in modes[r:] + modes[:r]]
    results = json.loads((out / "results.json").read_text())
    assert [r["mode"] for r in results["rows"]] == modes
    # The control (k=0 again) against k=0, round by round: three rounds, an interval around its ratio.
    (control,) = results["comparisons"]
    assert (control["mode"], control["reference"], control["rounds"]) == ("k=0 (control)", "k=0 (target only)", 3)
    assert control["low"] <= control["ratio"] <= control["high"]
    assert "| uniform c=1 | k=0 (control) | k=0 (target only) |" in (out / "results.md").read_text()
    for r in results["rows"]:
        assert r["requests"] == 6 and not r["errors"] and r["tokens"] == 6 * 5
        assert r["seconds"] > 0 and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert len(r["per_round"]) == 3 and all(value > 0 for value in r["per_round"])
    assert cli.main(["bench", "--address", stack.address, "--rounds", "0"]) == 2


def test_paired_ratio_is_the_geometric_mean_of_the_rounds_ratios_with_a_t_interval():
    from specbatch.commands.bench.pairs import paired_ratio, t975

    same = paired_ratio([10.0, 20.0, 40.0], [10.0, 20.0, 40.0])  # drift between rounds cancels
    assert same["ratio"] == pytest.approx(1.0) and same["low"] == pytest.approx(1.0) and same["high"] == pytest.approx(1.0)
    r = paired_ratio([11.0, 9.0 * 1.2, 12.0], [10.0, 9.0, 10.0])  # ratios 1.1, 1.2, 1.2
    logs = [math.log(1.1), math.log(1.2), math.log(1.2)]
    half = 4.303 * statistics.stdev(logs) / math.sqrt(3)
    assert r["rounds"] == 3 and r["ratio"] == pytest.approx(math.exp(statistics.fmean(logs)))
    assert (r["low"], r["high"]) == pytest.approx((math.exp(statistics.fmean(logs) - half),
                                                   math.exp(statistics.fmean(logs) + half)))
    assert paired_ratio([5.0], [4.0])["high"] == math.inf  # one round: no interval
    assert paired_ratio([0.0, 3.0], [1.0, 3.0])["rounds"] == 1  # a round with no result is left out
    assert t975(11) == 2.228 and t975(100) == 1.96


def test_compare_picks_the_best_fixed_k_and_reads_latency_inverted():
    from specbatch.commands.bench.pairs import compare, markdown

    per_round = {"k=0": [100.0, 80.0], "k=1": [120.0, 100.0], "goodput": [119.0, 99.5], "again": [101.0, 79.0]}
    rows = compare("uniform", per_round, ["k=0", "k=1"], ["goodput"], ("again", "k=0"))
    assert [(r["mode"], r["reference"]) for r in rows] == [("goodput", "k=1"), ("again", "k=0")]
    assert 0.99 < rows[0]["ratio"] < 1.0
    # Latency (the trace): lower is better, so the fixed mode with the lowest latency is the reference
    # and a policy with half its latency reads 2.
    latency = {"k=0": [4.0, 5.0], "k=1": [3.0, 4.0], "profile": [1.5, 2.0]}
    (row,) = compare("trace", latency, ["k=0", "k=1"], ["profile"])
    assert row["reference"] == "k=1" and row["ratio"] == pytest.approx(2.0)
    table = markdown([{"load": "uniform c=1", **r} for r in rows] + [{"load": "trace", **row}])
    assert "| uniform c=1 | goodput | k=1 |" in table and "| trace | profile | k=1 | 2.000 |" in table
    assert "not resolved" in table or "yes" in table


def test_a_closed_loop_over_a_trace_gains_latency_only_by_finishing_more_requests():
    trace = Trace("two", ((10.0, 1), (10.0, 4)))
    # 10 + 20 requests finish; the segments hold 1·10 + 4·10 request-seconds (Little's law).
    assert trace.closed_loop_latency({1: 10.0, 4: 20.0}, 10) == pytest.approx(50 / 30)
    assert trace.closed_loop_latency({1: 20.0, 4: 40.0}, 10) == pytest.approx(50 / 60)


def test_trace_headroom_bounds_what_a_policy_can_gain_over_the_best_fixed_k():
    from specbatch.commands.bench.report import trace_headroom

    measured = {"k=0 (target only)": {1: 10.0, 4: 40.0}, "k=1": {1: 20.0, 4: 30.0}, "goodput": {1: 19.0, 4: 39.0}}
    rows = [{"traffic": "uniform", "value": c, "mode": mode, "tokens_per_s": tps}
            for mode, levels in measured.items() for c, tps in levels.items()]
    trace = Trace("two", ((10.0, 1), (10.0, 4)))
    fixed = ["k=0 (target only)", "k=1"]
    table = trace_headroom(rows, trace, 10, fixed)
    # k=0 and k=1 both finish 50 requests (latency 1.0 s); the oracle runs k=1 at c=1 and k=0 at
    # c=4 and finishes 60: 16.7 % under; goodput finishes 58.
    assert "the best single fixed k is k=0 (target only)" in table
    assert "| oracle: the best fixed k of each segment | 0.83 | +16.7% |" in table
    assert "| goodput | 0.86 | +13.8% |" in table
    assert trace_headroom(rows, Trace("wide", ((10.0, 1), (10.0, 8))), 10, fixed) == ""  # c=8 not measured


def test_policies_are_also_compared_with_a_fixed_k_run_through_a_coordinator_of_its_own(stack, tokenizer, tmp_path):
    """--policies fixed:1,goodput: goodput is compared with the best per-request fixed k and, round
    by round, with fixed:1, which makes fixed decisions on the same path as goodput (its own
    coordinator)."""
    coordinators = policy_coordinators(stack, tokenizer, tmp_path, ("fixed:1", "goodput"))
    out = tmp_path / "out"
    code = bench_with_policies(stack, coordinators, "--fixed-k", "1", "--concurrency", "1", "--requests", "2",
                               "--rounds", "2", "--max-new-tokens", "4", "--prompts", "chat", "--out", str(out))
    assert code == 0
    comparisons = json.loads((out / "results.json").read_text())["comparisons"]
    pairs = [(c["mode"], c["reference"] in ("k=0 (target only)", "k=1")) for c in comparisons[:2]]
    assert pairs == [("fixed:1", True), ("goodput", True)]
    (same_path,) = comparisons[2:]
    assert (same_path["mode"], same_path["reference"], same_path["rounds"]) == ("goodput", "fixed:1", 2)


def test_fixed_k_modes_verify_the_chain_alone():
    """The coordinator's policy may verify leaves beside the chain (`specbatch up` gives goodput
    three to price); a fixed-k mode asks for none, so it stays the paper's baseline."""
    from specbatch.commands.bench.run import Mode, mode_request

    fixed = mode_request(Mode("k=2", None, 2), "hello", 5)
    assert fixed.k == 2 and fixed.HasField("leaves") and fixed.leaves == 0
    policy = mode_request(Mode("goodput", None, None), "hello", 5)
    assert not policy.HasField("k") and not policy.HasField("leaves")


def test_fixed_modes_may_name_leaves_beside_the_chain():
    """--fixed-k 1+2: k = 1 with two of the draft's next-best tokens verified beside it, a fixed
    mode too (the leaves' worth measured on its own, against what goodput prices them at)."""
    from specbatch.commands.bench.run import Mode, fixed_modes, fixed_name, mode_request

    assert fixed_modes("2,1+2,3+0", 3) == [(2, 0), (1, 2), (3, 0)]
    assert fixed_modes(None, 3) == [(3, 0)]
    assert [fixed_name(*pair) for pair in fixed_modes("2,1+2", 3)] == ["k=2", "k=1+2 leaves"]
    with pytest.raises(ValueError, match="K >= 1"):
        fixed_modes("0+1", 3)
    request = mode_request(Mode("k=1+2 leaves", None, 1, 2), "hello", 5)
    assert request.k == 1 and request.leaves == 2


def test_gpu_bundle_cuts_the_gguf_into_parts_that_fit_a_call_and_add_up(tmp_path, monkeypatch):
    """A lent GPU's call carries at most 64 MiB with the working tree: the embedded GGUF travels in
    parts, each of which must fit beside the tree, and gpu.sh puts them together in the order the
    bundle lists them; a short tail rides in the bundle, a long one is carried on its own."""
    import hashlib
    import importlib.util

    import specbatch.models.loading

    spec = importlib.util.spec_from_file_location("gpu_bundle", Path(__file__).parents[1] / "benchmarks" / "gpu_bundle.py")
    bundle_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bundle_module)
    monkeypatch.setattr(bundle_module, "PART_BYTES", 1000)
    monkeypatch.setattr(bundle_module, "TAIL_IN_BUNDLE", 100)
    monkeypatch.setattr(specbatch.models.loading, "embedded_gguf_folder", lambda: tmp_path / "model")
    (tmp_path / "model").mkdir()
    for size, carried in ((2050, 2), (2500, 3)):
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        (tmp_path / "model" / specbatch.models.embedded.EMBEDDED_GGUF).write_bytes(data)
        bundle = tmp_path / f"bundle-{size}"
        separate = bundle_module.split_gguf(tmp_path / f"parts-{size}", bundle)
        assert len(separate) == carried
        assert all((part / "gguf").stat().st_size <= 1000 for part in separate)
        listed = [Path(line) for line in (bundle / "gguf" / "parts").read_text().split()]
        assert listed[:carried] == separate
        assert b"".join((part / "gguf").read_bytes() for part in listed) == data
        assert (bundle / "gguf" / "sha256").read_text().strip() == hashlib.sha256(data).hexdigest()
