"""Drafting the next step inside a Verify, on a target that hosts the draft in its own process
(``python -m target_service --with-draft``).

After the verdict, each sequence that asked (``NextDraft``) has the draft read what it has not
cached, the verdict's kept tokens and its next token, with the target's features at them taken
straight from this forward, and propose k tokens. A speculative step then costs one call instead of
a Verify and a Propose, and the features the draft reads never cross the wire before it reads them.
The draft's cache stays rebuildable: the caller names what it holds (``keep_len``) and sends the
tokens and features of the history it lacks, as it would to a Propose.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draft_service.proposer import Proposal, ProposeItem, proposals
from draft_service.proposer import check as check_proposals
from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.protocol.errors import InvalidRequest

from .verifier import Verdict, VerifyItem


@dataclass
class NextDraft:
    """What one Verify item asks of the hosted draft after its verdict."""

    k: int
    # The draft's cache: keep_len its cached tokens, tokens the history after them (ending with the
    # token this Verify feeds last), features the target's before the first len(features) of them
    # (the rest are this Verify's).
    draft: SequenceInput
    leaves: list[int] = field(default_factory=list)

    def held_rows(self) -> int:
        return 0 if self.draft.features is None else int(self.draft.features.shape[0])


def check(draft: Engine, items: list[VerifyItem], nexts: list[NextDraft | None]) -> None:
    """Refuse, before anything runs, what no verdict could make right: k and leaves out of range,
    more feature rows than tokens, a draft cache the draft does not hold, a context the longest
    outcome (every draft kept) would overflow. Runs on the model thread (it reads the caches)."""
    asked = [(item, next) for item, next in zip(items, nexts) if next is not None]
    if not asked:
        return
    check_proposals([ProposeItem(next.draft, next.k, item.sampling, next.leaves) for item, next in asked])
    longest = []
    for item, next in asked:
        if next.draft.seq_id != item.seq.seq_id:
            raise InvalidRequest(f"sequence {item.seq.seq_id!r}: propose_next names sequence {next.draft.seq_id!r}")
        if next.held_rows() > len(next.draft.tokens):
            raise InvalidRequest(f"sequence {item.seq.seq_id!r}: propose_next carries {next.held_rows()} feature rows "
                                 f"for {len(next.draft.tokens)} tokens")
        tokens = next.draft.tokens + item.drafts + [0]
        features = torch.zeros(len(tokens), draft.feature_size) if draft.feature_size else None
        longest.append(SequenceInput(item.seq.seq_id, next.draft.keep_len, tokens, features))
    draft.validate(longest, [next.k - 1 for _, next in asked], create=True)


def propose_after(draft: Engine, items: list[VerifyItem], verdicts: list[Verdict],
                  nexts: list[NextDraft | None]) -> list[Proposal | None]:
    """The draft's proposal for each sequence that asked, after its verdict (None for the others).
    A draft that reads target features gets the caller's rows, then this Verify's kept rows for
    the rest of its tokens (the verdicts must carry them: the Verify returned features)."""
    asked = [i for i, next in enumerate(nexts) if next is not None]
    if not asked:
        return [None] * len(items)
    propose_items = []
    for i in asked:
        item, verdict, next = items[i], verdicts[i], nexts[i]
        tokens = next.draft.tokens + item.taken(verdict)
        features = None
        if draft.feature_size:
            own = len(tokens) - next.held_rows()  # the rows this Verify computed, its last kept ones
            computed = verdict.features
            if computed is None or own > computed.shape[0]:
                raise InvalidRequest(f"sequence {item.seq.seq_id!r}: the draft's tokens start before the features "
                                     "this Verify and the caller's rows cover")
            rows = computed[computed.shape[0] - own :]
            if next.held_rows():
                rows = torch.cat([next.draft.features, rows])
            features = rows.to(torch.float32)  # one conversion: float32 holds what cat promotes to exactly
        propose_items.append(ProposeItem(SequenceInput(item.seq.seq_id, next.draft.keep_len, tokens, features),
                                         next.k, item.sampling, next.leaves))
    out: list[Proposal | None] = [None] * len(items)
    for i, proposal in zip(asked, proposals(draft, propose_items)):
        out[i] = proposal
    return out
