import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny import tiny_llama, tiny_tokenizer  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: uses the embedded SmolLM2-135M-Instruct (slower)")


@pytest.fixture(autouse=True, scope="session")
def results_elsewhere(tmp_path_factory):
    """What the commands under test write as results (``specbatch.commands.results.write``) goes
    to a folder of the session's own, never into the checkout's benchmarks/results; so do the
    profiles a learn policy keeps."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECBATCH_RESULTS", str(tmp_path_factory.mktemp("results")))
        # and what learn policies learn, so that no test starts from another's (or a user's)
        patch.setenv("SPECBATCH_PROFILES", str(tmp_path_factory.mktemp("learned-profiles")))
        yield


@pytest.fixture(autouse=True)
def root_logging():
    """Restore the root logger after every test. A main() run in process (the coordinator's, a
    service's) calls configure_logging, which binds a handler to the sys.stderr of that moment:
    under pytest a capture file that is closed after the test, so later tests' log records (a
    prober thread's "replica is serving") would print "Logging error" tracebacks instead."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def target_model():
    return tiny_llama(layers=3, seed=0)


@pytest.fixture(scope="session")
def draft_model(target_model):
    """A draft that agrees with the target often but not always: target's first 2 layers."""
    import copy

    from specbatch.models.loading import keep_first_layers

    draft = copy.deepcopy(target_model)
    keep_first_layers(draft, 2)
    return draft


@pytest.fixture
def stack(target_model, draft_model, tokenizer):
    from specbatch.stack.in_process import start_local_stack

    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8, max_new_tokens=128)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def zygote():
    """Service processes forked from one that has imported them (``specbatch.stack.prefork``): a service
    starts without the seconds its imports would take. Tests of the plain ``python -m``
    start keep ``prefork.popen``."""
    import os

    from specbatch.stack.prefork import Zygote

    # OpenMP sizes its pool once, at import: one thread, as every test service runs.
    zygote = Zygote(env={**os.environ, "OMP_NUM_THREADS": "1"})
    yield zygote
    zygote.close()
