"""The profile and goodput policies inside a running coordinator: greedy output stays exactly
target-only decoding while k changes from step to step; Info reports the policy and the profile
in force, and a changed profile file is taken up while serving; bad profiles stop the coordinator
at start with a clear message."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest
from test_exactness import prompts_of_lengths, run_staggered_and_check
from test_profile import gpu_like, synthetic_profile
from tiny import greedy_reference

from coordinator import app
from specbatch.commands import cli
from specbatch.config.speculation import SpeculationConfig
from specbatch.rpc.client import generate, make_request
from specbatch.stack.in_process import start_local_stack
from specbatch.stack.processes import LocalProcesses
from specbatch.v1 import generation_pb2 as pb

HIGH = [0.9, 0.85, 0.8, 0.75, 0.7, 0.65]


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    profile = synthetic_profile(gpu_like, HIGH, sizes=(1, 2, 4, 8))
    # k falls with the batch size, so a run where requests come and go switches k at many steps.
    assert len(set(profile.best_k.values())) >= 3
    profile.save(path)
    return path


@pytest.mark.parametrize("policy", ["profile", "goodput"])
def test_greedy_output_is_exact_while_k_follows_the_batch(target_model, draft_model, tokenizer, profile_path, policy):
    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8, max_new_tokens=128, speculation=SpeculationConfig(k_policy=policy, profile=str(profile_path)))
    try:
        client = stack.client()
        lengths = [1 + (i * 7) % 41 for i in range(16)]
        prompts = prompts_of_lengths(lengths, seed=5)
        new_tokens = [12 + (i * 5) % 29 for i in range(16)]
        run_staggered_and_check(client, target_model, prompts, new_tokens)
        info = client.Info(pb.InfoRequest())
        assert info.k_policy == policy
        used = [k for k, n in enumerate(info.totals.k_histogram) if n and k > 0]
        assert len(used) >= 2, f"k never changed: {list(info.totals.k_histogram)}"
        assert sum(info.totals.reached_by_position) > 0
        assert info.totals.reached_by_position[0] >= info.totals.accepted_by_position[0]
    finally:
        stack.stop()


def test_info_reports_the_profile_and_takes_up_a_new_one(target_model, draft_model, tokenizer, profile_path):
    stack = start_local_stack(target_model, draft_model, tokenizer,
                              profile_poll_seconds=0.05, speculation=SpeculationConfig(k_policy="profile", profile=str(profile_path)))
    try:
        client = stack.client()
        info = client.Info(pb.InfoRequest())
        assert info.k_policy == "profile"
        shown = json.loads(info.profile)
        assert shown["best_k"] == json.loads(profile_path.read_text())["best_k"]
        # Drafting never pays in the new profile: the coordinator follows it without a restart.
        synthetic_profile(lambda b, k: 10.0 * (k + 1) * b, HIGH, sizes=(1, 2, 4, 8)).save(profile_path)
        os.utime(profile_path, ns=(time.time_ns(), time.time_ns()))
        deadline = time.monotonic() + 10
        while json.loads(client.Info(pb.InfoRequest()).profile)["best_k"]["1"] != 0:
            assert time.monotonic() < deadline, "the new profile was not taken up"
            time.sleep(0.05)
        result = generate(client, make_request([1, 9, 17, 30], 20, ignore_eos=True))
        assert result.stats.draft_tokens_proposed == 0
        # A broken update is ignored: the last good profile stays in force.
        profile_path.write_text("{")
        time.sleep(0.3)
        assert json.loads(client.Info(pb.InfoRequest()).profile)["best_k"]["1"] == 0
    finally:
        stack.stop()


def test_with_no_profile_it_learns_one_keeps_it_and_starts_from_it_next_time(target_model, draft_model, tokenizer,
                                                                             caplog, tmp_path, monkeypatch):
    """No profile: the learn policy, nothing to show before a step is measured; what it learned is
    in Info, in the profile format, and kept at stop for the next coordinator of the same pair on
    this machine, which starts from it."""
    monkeypatch.setenv("SPECBATCH_PROFILES", str(tmp_path / "learned"))  # nothing learned before
    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=4)
    try:
        client = stack.client()
        info = client.Info(pb.InfoRequest())
        assert info.k_policy == "learn" and info.profile == ""
        for seed in range(4):
            generate(client, make_request([1, 9, 17, 30 + seed], 48, ignore_eos=True))
        learned = json.loads(client.Info(pb.InfoRequest()).profile)
        assert learned["workload"]["learned"] and learned["target"]["model"] == "target"
        assert learned["draft"]["model"] == "draft" and learned["hardware"]["device"] == "cpu"
        assert learned["batch_sizes"] == [1] and learned["max_k"] >= 1
        path = stack.coordinator.keeper.path
        # An operator publishes it as the shared profile (the ConfigMap): a file goodput serves.
        published = tmp_path / "published.json"
        assert cli.main(["profile", "--from-coordinator", stack.address, "--out", str(published)]) == 0
        assert json.loads(published.read_text())["best_k"] == learned["best_k"]
    finally:
        stack.stop()
    assert json.loads(path.read_text())["batch_sizes"] == [1]  # kept at stop
    with caplog.at_level("INFO", logger="coordinator.choose"):
        again = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=4)
    try:
        assert "starting from what was learned before" in caplog.text
        assert json.loads(again.client().Info(pb.InfoRequest()).profile)["batch_sizes"] == [1]
    finally:
        again.stop()


def test_a_profile_of_another_deployment_is_flagged_and_learned_over(target_model, draft_model, tokenizer, tmp_path,
                                                                     caplog):
    """A profile measured on a GPU (or for another pair) is not trusted on this CPU: the
    coordinator says so at start and learns instead; its output stays exact."""
    path = tmp_path / "gpu.json"
    synthetic_profile(gpu_like, HIGH, hardware={"device": "cuda", "gpu": "NVIDIA H100"}).save(path)
    with caplog.at_level("WARNING", logger="coordinator.choose"):
        stack = start_local_stack(target_model, draft_model, tokenizer,
                                  speculation=SpeculationConfig(k_policy="goodput", profile=str(path)))
    try:
        assert "measured for another deployment" in caplog.text and "device: the profile's 'cuda'" in caplog.text
        assert stack.client().Info(pb.InfoRequest()).k_policy == "learn"
        # `specbatch up` reads the policy in force the same way, to say it learns instead.
        assert LocalProcesses.k_policy_in_force(SimpleNamespace(address=stack.address)) == "learn"
        prompt = [1, 9, 17, 30]
        result = generate(stack.client(), make_request(prompt, 24, ignore_eos=True))
        assert list(result.token_ids) == greedy_reference(target_model, prompt, 24)
    finally:
        stack.stop()


@pytest.mark.parametrize("argv, message", [
    (["--k-policy", "goodput"], "the goodput policy needs a profile: pass --profile PATH"),
    (["--k-policy", "profile", "--profile", "{missing}"], "cannot read it"),
    (["--k-policy", "fixed:2", "--profile", "{bad}"], "this coordinator reads profile version 1 (got 3)"),
    (["--k-policy", "adaptive"], "unknown k policy 'adaptive'"),
])
def test_coordinator_refuses_a_bad_profile_at_start(tmp_path, capsys, argv, message):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**synthetic_profile(gpu_like, HIGH).to_dict(), "version": 3}))
    argv = [a.format(missing=tmp_path / "missing.json", bad=bad) for a in argv]
    # An unreachable target: the coordinator must exit before it would wait for one.
    with pytest.raises(SystemExit) as exit:
        app.main(argv + ["--target", "127.0.0.1:1", "--wait-for-services", "0.1"])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err
