"""The target service's gRPC servicer: a thin shell over the engine and the verifier."""

from __future__ import annotations

import logging

from specbatch.models.eagle import target_feature_size
from specbatch.protocol.emulation import describe
from specbatch.rpc.server import engine_errors_to_status
from specbatch.service.servicer import (
    CacheServicer,
    distribution_from_proto,
    features_to_bytes,
    sampling_from_proto,
    sequence_inputs,
)
from specbatch.v1 import model_services_pb2 as pb
from specbatch.v1 import model_services_pb2_grpc as pb_grpc

from .verifier import VerifyItem, check, verify

log = logging.getLogger(__name__)


class TargetServicer(CacheServicer, pb_grpc.TargetServicer):
    add_to_server = staticmethod(pb_grpc.add_TargetServicer_to_server)
    service_name = "specbatch.v1.Target"

    def __init__(self, engine, model_name: str, metrics=None, emulated_acceptance: tuple[float, ...] | None = None):
        """``emulated_acceptance``: --emulate-acceptance's rates (for timing only; None: off)."""
        super().__init__(engine, model_name, metrics)
        self.emulated = tuple(emulated_acceptance) if emulated_acceptance else None
        if self.emulated is not None:
            # Loud, because its output is not the target's: it must never pass unnoticed.
            log.warning("EMULATED ACCEPTANCE: drafts are kept by seeded draws at rates %s per position (the last "
                        "repeating), not verified; output is NOT the target's, for timing only",
                        describe(self.emulated))
            if metrics is not None:
                metrics.report_emulated_acceptance(self.emulated)

    @classmethod
    def serve_on(cls, server, engine, model_name: str, metrics=None,
                 emulated_acceptance: tuple[float, ...] | None = None) -> TargetServicer:
        servicer = cls(engine, model_name, metrics, emulated_acceptance)
        server.add(cls.add_to_server, servicer, cls.service_name)
        return servicer

    @engine_errors_to_status
    def Verify(self, request, context):
        seqs = sequence_inputs(self.engine, (item.sequence for item in request.items))
        items = [VerifyItem(seq, list(item.draft_tokens), sampling_from_proto(item.sampling),
                            [distribution_from_proto(d) for d in item.draft_distributions],
                            [list(at.tokens) for at in item.leaves])
                 for seq, item in zip(seqs, request.items)]
        check(items)  # before the call waits for the model
        verdicts, seconds = self.observed("Verify", len(items), verify, self.engine, items, request.create,
                                          request.return_features, self.emulated)
        return pb.VerifyResponse(
            verdicts=[
                pb.Verdict(seq_id=item.seq.seq_id, accepted=v.accepted, next_token=v.next_token, cached_len=v.cached_len,
                           features=features_to_bytes(v.features), leaf=v.leaf)
                for item, v in zip(items, verdicts)
            ],
            compute_seconds=seconds,
        )

    def CacheStats(self, request, context):
        stats = super().CacheStats(request, context)
        stats.emulated_acceptance = describe(self.emulated)
        return stats

    def feature_size(self) -> int:
        return target_feature_size(self.engine.model)  # the features it returns
