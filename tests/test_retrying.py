"""The coordinator's calls retry transient failures (a service restarting, a lost connection) with
exponential backoff, and nothing else."""

from __future__ import annotations

import grpc
import pytest

from coordinator import backends
from specbatch.rpc.local import LocalRpcError


class Flaky:
    """Fails with ``code`` ``failures`` times, then answers."""

    def __init__(self, failures: int, code=grpc.StatusCode.UNAVAILABLE):
        self.failures, self.code, self.calls = failures, code, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if len(self.calls) <= self.failures:
            raise LocalRpcError(self.code, "not now")
        return "answer"


@pytest.fixture
def waits(monkeypatch):
    slept = []
    monkeypatch.setattr("time.sleep", slept.append)  # tenacity's waits go through time.sleep too
    return slept


@pytest.mark.parametrize("failures", [0, 1, 3])
def test_transient_failures_are_retried_with_doubling_waits(waits, failures):
    call = Flaky(failures)
    assert backends.Retrying(4)(call, "Verify", timeout=1.0) == "answer"
    assert call.calls == [(("Verify",), {"timeout": 1.0})] * (failures + 1)
    assert waits == pytest.approx([0.05, 0.1, 0.2][:failures])


def test_the_last_transient_failure_reaches_the_caller_after_every_attempt(waits):
    call = Flaky(9)
    with pytest.raises(grpc.RpcError) as raised:
        backends.Retrying(4)(call)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE and len(call.calls) == 4
    assert len(waits) == 3


@pytest.mark.parametrize("code", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT])
def test_other_failures_are_not_retried(waits, code):
    call = Flaky(1, code)
    with pytest.raises(grpc.RpcError) as raised:
        backends.Retrying(4)(call)
    assert raised.value.code() == code and len(call.calls) == 1 and waits == []


def test_one_attempt_never_retries(waits):
    call = Flaky(1)
    with pytest.raises(grpc.RpcError):
        backends.Retrying(1)(call)
    assert len(call.calls) == 1 and waits == []
