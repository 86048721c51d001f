"""The services' clients over servicers in this process: the coordinator's own calls, with the
same messages and the same errors, but no channel and no socket. For driving the coordinator's
scheduler where the models are loaded beside it (distill's evaluation, the draft benchmarks);
served, it calls the services through coordinator/backends.py."""

from __future__ import annotations

import grpc

from specbatch.rpc.local import LocalContext, LocalRpcError
from specbatch.v1 import model_services_pb2 as pb

from .backends import DraftClient, Retrying, TargetClient, Traffic


class InProcess:
    """In place of ServiceClient's transport: a call is the servicer's method on the request
    message; a servicer that aborts raises the grpc.RpcError a remote call would."""

    def __init__(self, servicer, address: str = "in-process", timeout: float = 600.0):
        self.servicer, self.address, self.timeout = servicer, address, timeout
        self.channel, self.local = None, None
        self.traffic = Traffic()
        self.retry = Retrying(1)  # nothing to reconnect: a failure is the servicer's answer

    def _send(self, method: str, request, timeout: float):
        context = LocalContext(timeout)  # what the servicers use of a gRPC context
        try:
            return getattr(self.servicer, method)(request, context)
        except Exception:
            if context.code == grpc.StatusCode.OK:  # not an abort: a fault, raised as it is
                raise
            raise LocalRpcError(context.code, context.message) from None

    def cache_stats(self) -> pb.CacheStatsResponse:
        return self._send("CacheStats", pb.CacheStatsRequest(), self.timeout)

    def close(self) -> None:
        pass


class InProcessTarget(InProcess, TargetClient):
    """A TargetClient over a target_service.servicer.TargetServicer in this process."""

    def __init__(self, servicer, address: str = "in-process target", timeout: float = 600.0):
        super().__init__(servicer, address, timeout)


class InProcessDraft(InProcess, DraftClient):
    """A DraftClient over a draft_service.servicer.DraftServicer in this process (the address of
    its target's, for a draft hosted there: the coordinator then drafts inside each Verify)."""

    def __init__(self, servicer, address: str = "in-process draft", timeout: float = 600.0):
        super().__init__(servicer, address, timeout)
