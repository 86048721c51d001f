"""specbatch.stack.prefork: children forked from a zygote behave as ``python -m`` processes would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from specbatch.stack.prefork import Zygote

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def small_zygote():
    # Imports torch (its OpenMP pool sized at 1 here) and finds tests/prefork_child.py.
    zygote = Zygote(preload=("torch",), env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS)})
    yield zygote
    zygote.close()


def seen(path: Path, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, "the child never wrote"
        time.sleep(0.02)
    return json.loads(path.read_text())


def test_a_child_runs_the_module_as_main_with_its_args_env_and_exit_code(small_zygote, tmp_path):
    out = tmp_path / "seen.json"
    child = small_zygote.start("prefork_child", [str(out), "3"], {**os.environ, "COLOR": "teal", "OMP_NUM_THREADS": "2"})
    assert child.wait(60) == 3 and child.returncode == 3 and child.poll() == 3
    assert seen(out) == {"argv": [str(TESTS / "prefork_child.py"), str(out), "3"],  # as python -m sets it
                         "name": "__main__", "color": "teal",
                         "threads": 2,  # the child's OMP_NUM_THREADS, not the zygote's 1
                         "stdin": ""}  # not the zygote's command pipe


def test_signals_reach_the_child_and_show_in_its_return_code(small_zygote, tmp_path):
    children = [small_zygote.start("prefork_child", [str(tmp_path / f"{n}.json"), "wait"]) for n in range(2)]
    for n, child in enumerate(children):
        seen(tmp_path / f"{n}.json")  # running
        assert child.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.2)
    children[0].terminate()
    children[1].kill()
    assert [child.wait(30) for child in children] == [-signal.SIGTERM, -signal.SIGKILL]
    children[0].kill()  # a child that has exited is never signalled again (its pid may be reused)


def test_closing_the_zygote_ends_its_children(tmp_path):
    zygote = Zygote(preload=(), env={**os.environ, "PYTHONPATH": str(TESTS)})
    child = zygote.start("prefork_child", [str(tmp_path / "seen.json"), "wait"])
    seen(tmp_path / "seen.json")
    zygote.close()
    assert child.wait(10) == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(child.pid, 0)


def test_a_module_that_fails_to_import_exits_1(small_zygote):
    assert small_zygote.start("no_such_module_here", []).wait(30) == 1
