"""The three servers in one process, on loopback ports: for tests, benchmarks and notebooks.

``specbatch up`` runs them as separate processes instead; the code they run is the same.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import grpc

from coordinator.app import Coordinator, build_coordinator
from draft_service.servicer import DraftServicer
from specbatch.engine.engine import Engine
from specbatch.rpc.server import Server
from specbatch.v1 import generation_pb2_grpc
from target_service.servicer import TargetServicer


def serve_engine(engine: Engine, add_servicer, name: str, address: str = "127.0.0.1:0",
                 socket_dir: str | None = None, hosted_draft: Engine | None = None) -> Server:
    """``socket_dir``: its calls on a Unix socket there too (the coordinator then uses it).
    ``hosted_draft``: a target's server also hosts this draft engine (``--with-draft``)."""
    server = Server(address, max_workers=8)
    add_servicer(server, engine, name, **({"draft": hosted_draft, "draft_name": "draft"} if hosted_draft else {}))
    if socket_dir:
        server.serve_locally(socket_dir, name, loop=engine.model_thread)
    return server.start()


@dataclass
class LocalStack:
    targets: list[Server]  # one per target replica (usually one)
    drafts: list[Server]
    coordinator: Coordinator
    target_engines: list[Engine]
    draft_engines: list[Engine]

    # The first replica of each: most stacks have one.
    target = property(lambda self: self.targets[0])
    draft = property(lambda self: self.drafts[0] if self.drafts else None)
    target_engine = property(lambda self: self.target_engines[0])
    draft_engine = property(lambda self: self.draft_engines[0] if self.draft_engines else None)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.coordinator.port}"

    def client(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(self.address))

    def stop(self) -> None:
        self.coordinator.stop(grace=1)
        for server in dict.fromkeys(self.drafts + self.targets):  # a target hosting the draft: once
            server.stop(grace=1)


def _replica_model(model, index: int):
    return model if index == 0 else copy.deepcopy(model)


def start_local_stack(target_model, draft_model, tokenizer, eos_token_ids=frozenset(), target_engine_options=None,
                      target_replicas: int = 1, draft_replicas: int = 1, draft_engine_options=None,
                      socket_dir: str | None = None, draft_in_target: bool = False,
                      **coordinator_options) -> LocalStack:
    """Replicas after the first get a copy of the model: engines running side by side must not
    share one (each hooks the model's decoder during its forwards). ``socket_dir``: the services
    serve on local sockets there too, and the coordinator calls them that way. ``draft_in_target``:
    each target replica hosts a draft replica in its server, on its model thread (as
    ``--with-draft``); ``drafts`` then names the same servers as ``targets``."""
    target_engines = [Engine(_replica_model(target_model, i), **(target_engine_options or {}))
                      for i in range(target_replicas)]
    draft_count = (target_replicas if draft_in_target else draft_replicas) if draft_model is not None else 0
    draft_engines = [Engine(_replica_model(draft_model, i), **(draft_engine_options or {}),
                            **({"model_thread": target_engines[i].model_thread, "lock": target_engines[i].lock}
                               if draft_in_target else {}))
                     for i in range(draft_count)]
    if draft_in_target:
        targets = [serve_engine(engine, TargetServicer.serve_on, "target", socket_dir=socket_dir,
                                hosted_draft=draft_engines[i] if draft_engines else None)
                   for i, engine in enumerate(target_engines)]
        drafts = list(targets) if draft_engines else []
    else:
        targets = [serve_engine(engine, TargetServicer.serve_on, "target", socket_dir=socket_dir)
                   for engine in target_engines]
        drafts = [serve_engine(engine, DraftServicer.serve_on, "draft", socket_dir=socket_dir)
                  for engine in draft_engines]
    coordinator = build_coordinator(
        ",".join(f"127.0.0.1:{s.port}" for s in targets), ",".join(f"127.0.0.1:{s.port}" for s in drafts) or None,
        tokenizer, eos_token_ids=eos_token_ids, **coordinator_options,
    )
    return LocalStack(targets, drafts, coordinator, target_engines, draft_engines)
