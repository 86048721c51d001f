"""A Verify's further steps (``VerifyRequest.further_steps``): after the step it was asked for,
more steps of the same sequences in the same call, on the model thread, with no call between them.

Each further step of an item feeds the last verdict's next token and, where the item asked
``propose_next`` (a draft hosted here), the draft's proposal after that verdict as its drafts,
with as many of its leaves at each position as the first step verified there; it asks the same
``propose_next`` again. Items without ``propose_next`` decode one token a step. Every step's
verdicts go back to the caller, which applies them in order as if it had made a call per step:
it stays the owner of the history, and what the services hold stays rebuildable from it.

An item stops after a step that took one of its stop tokens, where its next step could take it past
its ``max_tokens`` (a call a step would draft fewer there) or leave its context no room for the
proposal after it, or where its draft holds other than what the next step needs; the call ends when
no item goes on. The tokens are the ones a call per step would give: each step is the same Verify
of the same drafts (the acceptance rule decides each row alone, and sampled rows draw by absolute
position)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from specbatch.engine.batch import SequenceInput
from specbatch.protocol.errors import InvalidRequest
from specbatch.protocol.speculation import MAX_FURTHER_STEPS

from .drafting import NextDraft
from .verifier import Verdict, VerifyItem

log = logging.getLogger(__name__)


@dataclass
class Further:
    """How far one item may go (``FurtherSteps``)."""

    max_tokens: int
    room: int
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)


@dataclass
class Step:
    """One step: its items (``indices``: where each sits in the call), each one's verdict and the
    hosted draft's proposal where asked (else None); compute seconds of the target and of the draft."""

    indices: list[int]
    items: list[VerifyItem]
    verdicts: list[Verdict]
    proposals: list
    seconds: float
    draft_seconds: float


def check(steps: int, furthers: list[Further | None]) -> None:
    """Refuse a step count out of range before anything runs."""
    if steps > MAX_FURTHER_STEPS:
        raise InvalidRequest(f"{steps} further steps: at most {MAX_FURTHER_STEPS}")
    for further in furthers:
        if further is not None and (further.max_tokens < 1 or further.room < 1):
            raise InvalidRequest("further.max_tokens and further.room must be at least 1")


def run(step, draft_length, items: list[VerifyItem], nexts: list[NextDraft | None], furthers: list[Further | None],
        first: Step, steps: int) -> list[Step]:
    """Up to ``steps`` further steps after ``first`` (the call's own step over every item).
    ``step(items, nexts)`` runs one Verify (and its proposals) on the model thread and returns
    (verdicts, proposals, seconds, draft seconds); ``draft_length(seq_id)``: what the hosted
    draft holds of a sequence."""
    taken = [0] * len(items)
    verified = [[len(at) for at in item.leaves] for item in items]
    nexts = list(nexts)
    out, last = [], first
    for _ in range(steps):
        indices, going = [], []
        for i, item, verdict, proposal in zip(last.indices, last.items, last.verdicts, last.proposals):
            further, took = furthers[i], item.taken(verdict)
            taken[i] += len(took)
            if further is None or any(token in further.stop_token_ids for token in took):
                continue
            follow = _follow(item, nexts[i], verdict, proposal, verified[i], draft_length)
            if follow is None:
                continue
            k = len(follow[0].drafts)
            # Where a call a step would cut its k (the tokens it may still use), it stops: the
            # next call decides that step, so the draws of sampled rows fall as they would.
            if taken[i] + k + 1 > further.max_tokens or further.room - taken[i] < 2 * (k + 1) + sum(verified[i]):
                continue
            indices.append(i)
            going.append(follow[0])
            nexts[i] = follow[1]
        if not indices:
            break
        try:
            last = Step(indices, going, *step(going, [nexts[i] for i in indices]))
        except Exception:  # noqa: BLE001 - the steps run so far stand; the caller rebuilds from them
            log.warning("a further step failed; the call returns the %d steps before it", len(out) + 1, exc_info=True)
            break
        out.append(last)
    return out


def _follow(item: VerifyItem, next: NextDraft | None, verdict: Verdict, proposal, verified: list[int],
            draft_length) -> tuple[VerifyItem, NextDraft | None] | None:
    """The item's next step after ``verdict`` (None: it stops): its next token, fed at the first
    position the target has not cached, with the proposal's drafts and leaves where it drafts."""
    seq_id = item.seq.seq_id
    seq = SequenceInput(seq_id, verdict.cached_len, [verdict.next_token])
    if next is None:
        return VerifyItem(seq, sampling=item.sampling), None
    if proposal is None or not proposal.tokens:
        return None
    held = draft_length(seq_id)
    if held < verdict.cached_len + 1:
        return None  # the draft lacks history the caller alone holds
    drafts = list(proposal.tokens)
    leaves = [list(at[:count]) for at, count in zip(proposal.leaves[: len(drafts)], verified)]
    follow = VerifyItem(seq, drafts, item.sampling, list(proposal.distributions), leaves)
    # The draft reads what this step keeps from its first fed position on, with this step's features.
    return follow, NextDraft(next.k, SequenceInput(seq_id, verdict.cached_len + 1, []), list(next.leaves))
