"""The profile document (specbatch/protocol/profile.py): schema, round trip, interpolation; and the file
the coordinator watches (coordinator/profile_file.py): reload on change, ConfigMap symlink swaps,
malformed profiles refused at start and ignored at reload."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

from coordinator.profile_file import ProfileFile
from specbatch.protocol.profile import (
    NEAR_BEST,
    Profile,
    ProfileError,
    best_k_of,
    build_profile,
    expected_tokens,
    load_profile,
)


def synthetic_profile(step_ms, acceptance, sizes=(1, 2, 4, 8, 16, 32), **about) -> Profile:
    """A profile whose step time at (batch, k) is ``step_ms(batch, k)``, of the tiny pair the
    tests' stacks serve on this CPU (``about`` says otherwise: coordinator/fit.py compares)."""
    max_k = len(acceptance)
    times = {(b, k): {"step_ms": step_ms(b, k), "draft_ms": 0.2 * k, "target_ms": step_ms(b, k) - 0.2 * k - 0.1,
                      "accepted_per_sequence": expected_tokens(acceptance, k) - 1}
             for b in sizes for k in range(max_k + 1)}
    return build_profile(list(sizes), max_k, list(acceptance), times, created="2026-01-01T00:00:00+00:00",
                         **{"hardware": {"device": "cpu"}, "target": {"model": "target", "dtype": "float32"},
                            "draft": {"model": "draft", "dtype": "float32"}, **about})


def gpu_like(b, k):
    """A fixed cost per step (weights read once) plus a cost per token verified: verifying k+1
    tokens costs little more than 1 at batch 1, nearly k+1 times as much at batch 32."""
    return 10.0 + 0.5 * k + 0.6 * b * (k + 1)


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5], 1) == 1.5
    assert expected_tokens([0.5, 0.5], 2) == 1.75
    assert expected_tokens([1.0] * 4, 4) == 5.0


def test_round_trip_through_json(tmp_path):
    profile = synthetic_profile(gpu_like, [0.8, 0.7, 0.6, 0.5])
    path = tmp_path / "profile.json"
    profile.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "specbatch-profile" and data["version"] == 1
    assert set(data) >= {"created", "hardware", "target", "draft", "workload", "batch_sizes", "max_k",
                         "acceptance_by_position", "table", "best_k"}
    assert len(data["table"]) == 6 * 5 and data["best_k"].keys() == {"1", "2", "4", "8", "16", "32"}
    again = load_profile(path)
    assert again.batch_sizes == profile.batch_sizes and again.best_k == profile.best_k
    assert again.acceptance_by_position == pytest.approx(profile.acceptance_by_position)
    for key, cell in profile.cells.items():
        assert again.cells[key].step_ms == pytest.approx(cell.step_ms, abs=1e-3)
        assert again.cells[key].ms_per_token == pytest.approx(cell.ms_per_token, abs=1e-3)
    assert again.to_dict() == data


def test_best_k_falls_as_the_batch_grows():
    """The paper's shape: long drafts at batch 1, short or none at batch 32."""
    profile = synthetic_profile(gpu_like, [0.8, 0.75, 0.7, 0.65, 0.6, 0.55])
    best = [profile.best_k[b] for b in profile.batch_sizes]
    assert best == sorted(best, reverse=True)
    assert best[0] >= 3 and best[-1] <= 1
    # best_k is the smallest k within NEAR_BEST of the lowest ms_per_token
    for b in profile.batch_sizes:
        row = [profile.cells[b, k].ms_per_token for k in range(profile.max_k + 1)]
        best = profile.best_k[b]
        assert row[best] <= min(row) * (1 + NEAR_BEST) and all(ms > min(row) * (1 + NEAR_BEST) for ms in row[:best])


@pytest.mark.parametrize("row, best", [
    ([10.0, 8.0, 7.0, 6.9], 2),  # 1.4 % apart: the smaller k
    ([10.0, 8.0, 7.0, 6.6], 3),  # 6 % apart: the faster one
    ([10.0, 8.0, 8.0, 9.0], 1),  # a tie
    ([5.0, 5.2, 4.9, 6.0], 0),  # within 5 % of the lowest, k = 0 first
])
def test_best_k_is_the_smallest_within_the_profiles_resolution(row, best):
    assert best_k_of(row) == best


def test_interpolation_between_profiled_sizes():
    profile = synthetic_profile(lambda b, k: 10.0 + b * (k + 1), [0.5] * 6, sizes=(1, 4, 8))
    assert profile.step_ms(1, 0) == pytest.approx(11.0)
    assert profile.step_ms(2, 0) == pytest.approx(12.0)  # linear between 1 and 4
    assert profile.step_ms(6, 1) == pytest.approx(22.0)  # between 4 (18) and 8 (26)
    assert profile.step_ms(16, 1) == pytest.approx(42.0)  # the last segment extended
    assert profile.step_ms(0.5, 0) == pytest.approx(11.0)  # never below the smallest measured

    hand = Profile.from_dict({**profile.to_dict(), "best_k": {"1": 6, "4": 2, "8": 0}})
    assert [hand.best_k_for(b) for b in (1, 2, 3, 4, 5, 6, 7, 8, 32)] == [6, 5, 3, 2, 2, 1, 1, 0, 0]


def _valid() -> dict:
    return synthetic_profile(gpu_like, [0.8, 0.7], sizes=(1, 2)).to_dict()


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format="other"), "'format' must be 'specbatch-profile'"),
    (lambda d: d.update(version=2), "reads profile version 1"),
    (lambda d: d.pop("table"), "missing table"),
    (lambda d: d["table"].pop(), "table lacks"),
    (lambda d: d["table"].append(dict(d["table"][0])), "appears twice"),
    (lambda d: d["table"][0].update(step_ms=-1), "step_ms must be in"),
    (lambda d: d["table"][1].update(step_ms=float("nan")), "must be a finite number"),
    (lambda d: d["table"][0].pop("target_ms"), "lacks 'target_ms'"),
    (lambda d: d["table"][0].update(k=9), "outside the grid"),
    (lambda d: d.update(acceptance_by_position=[0.5, 1.5]), "acceptance_by_position[1] must be in"),
    (lambda d: d.update(acceptance_by_position=[0.5]), "must list max_k = 2"),
    (lambda d: d.update(batch_sizes=[2, 1]), "increasing"),
    (lambda d: d.update(best_k={"1": 5}), "exceeds max_k"),
    (lambda d: d.update(best_k={"one": 1}), "not a batch size"),
    (lambda d: d.update(best_k={}), "best_k must be a non-empty"),
    (lambda d: d.update(hardware="cpu"), "hardware must be an object"),
])
def test_malformed_documents_are_refused_with_a_reason(change, message):
    data = _valid()
    change(data)
    with pytest.raises(ProfileError, match=message.replace("[", r"\[").replace("(", r"\(")):
        Profile.from_dict(data)


def test_unreadable_files_are_refused(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(tmp_path / "bad.json")


# ---- the watched file ---------------------------------------------------------------------------

def _write(path, profile: Profile) -> None:
    """Write and make sure the change is visible to a stat even on a coarse-mtime filesystem."""
    path.write_text(profile.to_json())
    os.utime(path, ns=(time.time_ns(), time.time_ns()))


def test_reload_when_the_file_changes(tmp_path):
    path = tmp_path / "profile.json"
    first = synthetic_profile(gpu_like, [0.8, 0.7, 0.6])
    _write(path, first)
    watched = ProfileFile(path)
    assert watched.profile.best_k == first.best_k
    assert not watched.check()  # unchanged
    second = synthetic_profile(lambda b, k: 5.0 + 10.0 * k * b, [0.2, 0.1, 0.1])
    assert second.best_k != first.best_k
    _write(path, second)
    assert watched.check()
    assert watched.profile.best_k == second.best_k and watched.reloads == 1


def test_reload_follows_a_configmap_symlink_swap(tmp_path):
    """The kubelet's layout: profile.json -> ..data/profile.json, ..data -> ..<timestamp>/; an
    update writes a new timestamped directory and renames a new ..data link over the old one."""
    mount = tmp_path / "etc-specbatch"
    mount.mkdir()

    def publish(name: str, profile: Profile) -> None:
        version = mount / name
        version.mkdir()
        (version / "profile.json").write_text(profile.to_json())
        (mount / "..data_tmp").symlink_to(name)
        os.replace(mount / "..data_tmp", mount / "..data")  # atomic, as the kubelet does

    first = synthetic_profile(gpu_like, [0.8, 0.7, 0.6])
    publish("..2026_01_01_00_00_00.1", first)
    (mount / "profile.json").symlink_to("..data/profile.json")
    watched = ProfileFile(mount / "profile.json")
    assert watched.profile.best_k == first.best_k

    second = synthetic_profile(lambda b, k: 5.0 + 10.0 * k * b, [0.2, 0.1, 0.1])
    publish("..2026_01_01_00_01_00.2", second)
    assert watched.check()
    assert watched.profile.best_k == second.best_k


def test_malformed_profile_refused_at_start(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**_valid(), "version": 7}))
    with pytest.raises(ProfileError, match="version"):
        ProfileFile(path)


def test_malformed_profile_at_reload_keeps_the_old_one(tmp_path, caplog):
    path = tmp_path / "profile.json"
    good = synthetic_profile(gpu_like, [0.8, 0.7, 0.6])
    _write(path, good)
    watched = ProfileFile(path)
    with caplog.at_level(logging.WARNING, logger="coordinator.profile_file"):
        path.write_text('{"format": "specbatch-profile", "version": 1, "batch_sizes": [1]')  # cut short
        os.utime(path, ns=(time.time_ns(), time.time_ns()))
        assert not watched.check()
        assert not watched.check()  # reported once, not at every poll
        path.unlink()  # the file goes away
        assert not watched.check()
    assert watched.profile.best_k == good.best_k
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "not valid JSON" in warnings[0] and "stays in force" in warnings[0]
    assert "cannot read" in warnings[1]
    # A good version later is taken up.
    better = synthetic_profile(lambda b, k: 5.0 + 10.0 * k * b, [0.2, 0.1, 0.1])
    _write(path, better)
    assert watched.check() and watched.profile.best_k == better.best_k


def test_the_watcher_thread_picks_up_a_change(tmp_path):
    path = tmp_path / "profile.json"
    _write(path, synthetic_profile(gpu_like, [0.8, 0.7, 0.6]))
    watched = ProfileFile(path, poll_seconds=0.05).start()
    try:
        second = synthetic_profile(lambda b, k: 5.0 + 10.0 * k * b, [0.2, 0.1, 0.1])
        _write(path, second)
        deadline = time.monotonic() + 5
        while watched.profile.best_k != second.best_k and time.monotonic() < deadline:
            time.sleep(0.02)
        assert watched.profile.best_k == second.best_k
    finally:
        watched.stop()
