"""The draft service's gRPC servicer: a thin shell over the engine and the proposer."""

from __future__ import annotations

from specbatch.rpc.server import engine_errors_to_status
from specbatch.service.servicer import CacheServicer, distribution_to_proto, sampling_from_proto, sequence_inputs
from specbatch.v1 import model_services_pb2 as pb
from specbatch.v1 import model_services_pb2_grpc as pb_grpc

from .proposer import ProposeItem, check, proposals


class DraftServicer(CacheServicer, pb_grpc.DraftServicer):
    add_to_server = staticmethod(pb_grpc.add_DraftServicer_to_server)
    service_name = "specbatch.v1.Draft"

    @engine_errors_to_status
    def Propose(self, request, context):
        seqs = sequence_inputs(self.engine, (item.sequence for item in request.items))
        items = [ProposeItem(seq, item.k, sampling_from_proto(item.sampling), list(item.leaves))
                 for seq, item in zip(seqs, request.items)]
        check(items)  # before the call waits for the model
        drafts, seconds = self.observed("Propose", len(items), proposals, self.engine, items)
        return pb.ProposeResponse(
            proposals=[proposal_to_proto(item.seq.seq_id, proposal, self.engine.length(item.seq.seq_id))
                       for item, proposal in zip(items, drafts)],
            compute_seconds=seconds,
        )


def proposal_to_proto(seq_id: str, proposal, cached_len: int) -> pb.Proposal:
    """A proposer.Proposal as the Proposal message (a Propose's, or a hosted draft's inside a Verify)."""
    return pb.Proposal(seq_id=seq_id, tokens=proposal.tokens, cached_len=cached_len,
                       distributions=[distribution_to_proto(d) for d in proposal.distributions],
                       leaves=[pb.Leaves(tokens=at) for at in proposal.leaves])
