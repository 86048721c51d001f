"""The three servers in one process, on loopback ports: for tests, benchmarks and notebooks.

``specbatch up`` runs them as separate processes instead; the code they run is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from coordinator.app import Coordinator, build_coordinator
from draft_service.servicer import DraftServicer
from target_service.servicer import TargetServicer

from .engine import Engine
from .serving import Server
from .v1 import generation_pb2_grpc


def serve_engine(engine: Engine, add_servicer, name: str) -> Server:
    server = Server("127.0.0.1:0", max_workers=8)
    add_servicer(server, engine, name)
    return server.start()


@dataclass
class LocalStack:
    target: Server
    draft: Server | None
    coordinator: Coordinator
    target_engine: Engine
    draft_engine: Engine | None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.coordinator.port}"

    def client(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(self.address))

    def stop(self) -> None:
        self.coordinator.stop(grace=1)
        for server in filter(None, (self.draft, self.target)):
            server.stop(grace=1)


def start_local_stack(target_model, draft_model, tokenizer, eos_ids=frozenset(), target_engine_options=None,
                      **coordinator_options) -> LocalStack:
    target_engine = Engine(target_model, **(target_engine_options or {}))
    target = serve_engine(target_engine, TargetServicer.serve_on, "target")
    draft_engine = draft = None
    if draft_model is not None:
        draft_engine = Engine(draft_model)
        draft = serve_engine(draft_engine, DraftServicer.serve_on, "draft")
    coordinator = build_coordinator(
        f"127.0.0.1:{target.port}", f"127.0.0.1:{draft.port}" if draft else None, tokenizer,
        eos_ids=eos_ids, **coordinator_options,
    )
    return LocalStack(target, draft, coordinator, target_engine, draft_engine)
