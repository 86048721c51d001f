import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny import tiny_llama, tiny_tokenizer  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: uses the embedded SmolLM2-135M-Instruct (slower)")


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def target_model():
    return tiny_llama(layers=3, seed=0)


@pytest.fixture(scope="session")
def draft_model(target_model):
    """A draft that agrees with the target often but not always: target's first 2 layers."""
    from specbatch.models import keep_first_layers
    import copy

    draft = copy.deepcopy(target_model)
    keep_first_layers(draft, 2)
    return draft


@pytest.fixture
def stack(target_model, draft_model, tokenizer):
    from specbatch.commands.local import start_local_stack

    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8, max_new_tokens=128)
    yield stack
    stack.stop()
