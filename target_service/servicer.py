"""The target service's gRPC servicer: a thin shell over the engine and the verifier."""

from __future__ import annotations

from specbatch.models.eagle import target_feature_size
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


class TargetServicer(CacheServicer, pb_grpc.TargetServicer):
    add_to_server = staticmethod(pb_grpc.add_TargetServicer_to_server)
    service_name = "specbatch.v1.Target"

    @engine_errors_to_status
    def Verify(self, request, context):
        seqs = sequence_inputs(self.engine, (item.sequence for item in request.items))
        items = [VerifyItem(seq, list(item.draft_tokens), sampling_from_proto(item.sampling),
                            [distribution_from_proto(d) for d in item.draft_distributions],
                            [list(at.tokens) for at in item.leaves])
                 for seq, item in zip(seqs, request.items)]
        check(items)  # before the call waits for the model
        verdicts, seconds = self.observed("Verify", len(items), verify, self.engine, items, request.create,
                                          request.return_features)
        return pb.VerifyResponse(
            verdicts=[
                pb.Verdict(seq_id=item.seq.seq_id, accepted=v.accepted, next_token=v.next_token, cached_len=v.cached_len,
                           features=features_to_bytes(v.features), leaf=v.leaf)
                for item, v in zip(items, verdicts)
            ],
            compute_seconds=seconds,
        )

    def feature_size(self) -> int:
        return target_feature_size(self.engine.model)  # the features it returns
