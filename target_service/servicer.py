"""The target service's gRPC servicer: a thin shell over the engine and the verifier."""

from __future__ import annotations

import logging
import time

from draft_service.servicer import DraftServicer, proposal_to_proto
from specbatch.engine.batch import SequenceInput
from specbatch.models.eagle import target_feature_size
from specbatch.protocol.emulation import describe
from specbatch.protocol.errors import InvalidRequest
from specbatch.rpc.server import engine_errors_to_status
from specbatch.service.servicer import (
    CacheServicer,
    distribution_from_proto,
    features_from_bytes,
    features_to_bytes,
    sampling_from_proto,
    sequence_inputs,
)
from specbatch.v1 import model_services_pb2 as pb
from specbatch.v1 import model_services_pb2_grpc as pb_grpc

from . import drafting, further
from .drafting import NextDraft
from .verifier import VerifyItem, check, verify

log = logging.getLogger(__name__)


class TargetServicer(CacheServicer, pb_grpc.TargetServicer):
    add_to_server = staticmethod(pb_grpc.add_TargetServicer_to_server)
    service_name = "specbatch.v1.Target"

    def __init__(self, engine, model_name: str, metrics=None, emulated_acceptance: tuple[float, ...] | None = None,
                 draft=None, draft_name: str = ""):
        """``emulated_acceptance``: --emulate-acceptance's rates (for timing only; None: off).
        ``draft``: the Engine of a draft hosted in this process (--with-draft), on this engine's
        model thread; a Verify item's propose_next drafts with it (target_service/drafting.py)."""
        super().__init__(engine, model_name, metrics)
        self.draft, self.draft_name = draft, draft_name
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
                 emulated_acceptance: tuple[float, ...] | None = None, draft=None,
                 draft_name: str = "") -> TargetServicer:
        """With ``draft``: the hosted draft's own Draft service on the same server too, for the
        coordinator's other calls to it (its first Propose, Release, CacheStats)."""
        if draft is not None:
            DraftServicer.serve_on(server, draft, draft_name, metrics)
        servicer = cls(engine, model_name, metrics, emulated_acceptance, draft, draft_name)
        server.add(cls.add_to_server, servicer, cls.service_name)
        return servicer

    @engine_errors_to_status
    def Verify(self, request, context):
        seqs = sequence_inputs(self.engine, (item.sequence for item in request.items))
        items = [VerifyItem(seq, list(item.draft_tokens), sampling_from_proto(item.sampling),
                            [distribution_from_proto(d) for d in item.draft_distributions],
                            [list(at.tokens) for at in item.leaves])
                 for seq, item in zip(seqs, request.items)]
        nexts = [self._next_draft(item) for item in request.items]
        furthers = [further.Further(item.further.max_tokens, item.further.room, frozenset(item.further.stop_token_ids))
                    if item.HasField("further") else None for item in request.items]
        check(items)  # before the call waits for the model
        further.check(request.further_steps, furthers)
        draft_length = self.draft.length if self.draft is not None else None

        def call():  # on the model thread, every step of the call: no call between them
            first = further.Step(list(range(len(items))), items,
                                 *self._step(items, nexts, request.create, request.return_features))
            return [first, *further.run(lambda i, n: self._step(i, n, False, request.return_features),
                                        draft_length, items, nexts, furthers, first, request.further_steps)]

        done, _ = self.timed(call)
        if self.metrics is not None:  # each step as a call of its own would be
            for step in done:
                self.metrics.observe_call("Verify", len(step.items), step.seconds + step.draft_seconds)
        first, *more = (self._step_to_proto(step, request.return_features) for step in done)
        first.further_steps.extend(pb.StepVerdicts(verdicts=reply.verdicts, compute_seconds=reply.compute_seconds,
                                                   draft_compute_seconds=reply.draft_compute_seconds)
                                   for reply in more)
        return first

    def _step_to_proto(self, step: further.Step, return_features: bool) -> pb.VerifyResponse:
        return pb.VerifyResponse(
            verdicts=[
                pb.Verdict(seq_id=item.seq.seq_id, accepted=v.accepted, next_token=v.next_token, cached_len=v.cached_len,
                           features=features_to_bytes(v.features) if return_features else b"", leaf=v.leaf,
                           proposal=None if p is None else proposal_to_proto(item.seq.seq_id, p,
                                                                             self.draft.length(item.seq.seq_id)))
                for item, v, p in zip(step.items, step.verdicts, step.proposals)
            ],
            compute_seconds=step.seconds,
            draft_compute_seconds=step.draft_seconds,
        )

    def _next_draft(self, item) -> NextDraft | None:
        """A Verify item's propose_next, checked on the calling thread (None: not asked)."""
        if not item.HasField("propose_next"):
            return None
        seq_id = item.sequence.seq_id
        if self.draft is None:
            raise InvalidRequest(f"sequence {seq_id!r}: propose_next, but this target hosts no draft "
                                 "(python -m target_service --with-draft)")
        message = item.propose_next.draft
        features = features_from_bytes(seq_id, message.features, self.draft.feature_size)
        if features is not None and features.dim() != 2:
            raise InvalidRequest(f"sequence {seq_id!r}: propose_next's features are not rows of "
                                 f"{self.draft.feature_size} values")
        return NextDraft(item.propose_next.k, SequenceInput(seq_id, message.keep_len, list(message.tokens), features),
                         list(item.propose_next.leaves))

    def _step(self, items: list[VerifyItem], nexts: list[NextDraft | None], create: bool, return_features: bool):
        """On the model thread, one step: the draft's part checked, the Verify, then the hosted
        draft's proposals where asked (with the target's features of this forward, whether or not
        they are returned). Returns (verdicts, proposals, target seconds, draft seconds)."""
        started = time.perf_counter()
        drafting_asked = any(nexts)
        if drafting_asked:
            drafting.check(self.draft, items, nexts)
        verdicts = verify(self.engine, items, create,
                          return_features or (drafting_asked and bool(self.draft.feature_size)), self.emulated)
        verified = time.perf_counter()
        proposals = (drafting.propose_after(self.draft, items, verdicts, nexts) if drafting_asked
                     else [None] * len(items))
        return verdicts, proposals, verified - started, time.perf_counter() - verified

    def CacheStats(self, request, context):
        stats = super().CacheStats(request, context)
        stats.emulated_acceptance = describe(self.emulated)
        stats.hosted_draft = self.draft_name if self.draft is not None else ""
        return stats

    def feature_size(self) -> int:
        return target_feature_size(self.engine.model)  # the features it returns
