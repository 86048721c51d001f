"""Where a step's drafts come from. Each proposer fills the chains (coordinator/chain.py) that no
proposer asked before it filled, and the step asks them in order: the request's own history
(prompt lookup), the proposal a draft hosted in the target's process made inside the last Verify
(free by now: it takes lookup's place where it has kept more), then the texts of requests that
finished before it (shared lookup), then the draft service for the rest.

Prompt lookup (``prompt_lookup`` > 0): where the history's last tokens occurred before in the
request, the tokens that followed them are the step's drafts, and the request needs no Propose
(coordinator/lookup.py). The target verifies them like any draft, so output is unchanged.
"""

from __future__ import annotations

from typing import Protocol

from .chain import DRAFT, LOOKUP, SHARED, Chain
from .lookup import PromptLookup, SharedLookup
from .requests import Request


class Proposer(Protocol):
    def propose(self, chains: list[Chain], batch_size: int) -> float:
        """Fill what it can of the chains not filled yet; the seconds a service computed for it."""


def lookup_budget(chain: Chain, batch_size: int, prompt_lookup: int) -> int:
    """The most tokens a lookup drafts for a chain, within the request's --prompt-lookup (else the
    coordinator's ``prompt_lookup``). Alone in the batch, up to twice the step's k: its lookup
    spares the step's only draft call, and its runs are long. Beside others, up to k: the Propose
    happens anyway, so a longer chain saves no call, and the batch's verify rows stay what the
    policy chose (docs/decisions/prompt-lookup.md)."""
    setting = prompt_lookup if chain.request.prompt_lookup is None else chain.request.prompt_lookup
    return min(setting, (2 if batch_size == 1 else 1) * chain.k, chain.room)


# How fast a request's average of drafts kept per chain follows its latest chains.
KEPT_WEIGHT = 0.2


def kept(request: Request, source: str, accepted: int) -> None:
    """A chain from ``source`` kept ``accepted`` drafts: the request's average for it moves."""
    before = request.kept.get(source)
    request.kept[source] = accepted if before is None else (1 - KEPT_WEIGHT) * before + KEPT_WEIGHT * accepted


def prefers_draft(request: Request) -> bool:
    """Whether the draft's chains have kept more drafts for this request than prompt lookup's."""
    return request.kept.get(DRAFT, 0.0) > request.kept.get(LOOKUP, 0.0)


def prefers_lookup(request: Request) -> bool:
    """Whether prompt lookup's chains have kept more drafts for this request than the draft's
    (neither holds while both have kept as many, before either has drafted for it too)."""
    return request.kept.get(LOOKUP, 0.0) > request.kept.get(DRAFT, 0.0)


class AheadProposer:
    """The draft's proposals made inside the last Verify, after its verdict, by a draft hosted in
    the target's process. They cost the step nothing more, so prompt lookup's chain (asked first,
    for it spares a Propose elsewhere) gives way to one where the draft's chains have kept more
    for this request than lookup's (chat, where short matches copy the wrong words); where
    lookup's have kept more (code, where long runs repeat), lookup's stays."""

    def propose(self, chains: list[Chain], batch_size: int) -> float:
        for chain in chains:
            ahead = _ahead(chain.request) if chain.k else None
            if ahead is None:
                continue
            if chain.source == LOOKUP:
                if not prefers_draft(chain.request):
                    continue
                chain.source, chain.tokens, chain.distributions = None, [], []
            if chain.source is None:
                fill_from(chain, ahead)
        return 0.0


class PromptLookupProposer:
    """Drafts copied from the request's own history."""

    def __init__(self, prompt_lookup: int):
        self.prompt_lookup = prompt_lookup

    def propose(self, chains: list[Chain], batch_size: int) -> float:
        for chain in chains:
            most = lookup_budget(chain, batch_size, self.prompt_lookup)
            if chain.source is not None or most <= 0:  # k = 0 too: it does not speculate this step
                continue
            request = chain.request
            if request.lookup is None:
                request.lookup = PromptLookup()
            if found := request.lookup.drafts(request.history, most):
                chain.found(found, LOOKUP)
        return 0.0


class SharedLookupProposer:
    """Drafts from the texts of finished requests (those in the index: ``Request.shared_lookup``),
    where the request's own history has none."""

    def __init__(self, max_tokens: int, prompt_lookup: int):
        self.index = SharedLookup(max_tokens)
        self.prompt_lookup = prompt_lookup

    def propose(self, chains: list[Chain], batch_size: int) -> float:
        for chain in chains:
            if chain.source is None and chain.request.shared_lookup:
                most = lookup_budget(chain, batch_size, self.prompt_lookup)
                if most > 0 and (found := self.index.drafts(chain.request.history, most)):
                    chain.found(found, SHARED)
        return 0.0

    def finished(self, request: Request) -> None:
        """A request that ended with its output: its history joins the index (if it is in it)."""
        if request.shared_lookup and request.generated:
            self.index.add(request.history)


class DraftProposer:
    """Drafts from the draft service (through coordinator/services.py), for the chains that
    speculate and that no lookup filled. Where the draft fails or is missing, they stay empty:
    target-only for the step (k = 0), which is lossless."""

    def __init__(self, services):
        self.services = services

    def propose(self, chains: list[Chain], batch_size: int) -> float:
        asked = [chain for chain in chains if chain.k and chain.source is None and _can_draft(chain.request)]
        if not asked:
            return 0.0
        for chain in asked:
            chain.draft_read = len(chain.request.history) - chain.request.draft_len
        proposals, compute = self.services.propose(asked)
        for chain, proposal in zip(asked, proposals):
            if proposal is not None:
                chain.tokens, chain.distributions = list(proposal.tokens), proposal.distributions
                chain.next_best = [list(at.tokens) for at in proposal.leaves]
                chain.draft_cached, chain.source = proposal.cached_len, DRAFT
        return compute


def _ahead(request: Request):
    """The proposal the request's last Verify made for its history as it is (a draft hosted in
    the target's process), if any."""
    ahead = request.ahead
    return ahead if ahead is not None and request.ahead_at == len(request.history) and ahead.tokens else None


def fill_from(chain: Chain, ahead) -> None:
    """The chain's drafts from a proposal made ahead (``_ahead``), cut to its k."""
    k = min(chain.k, len(ahead.tokens))
    chain.tokens, chain.distributions = list(ahead.tokens[:k]), list(ahead.distributions[:k])
    chain.next_best = [list(at.tokens) for at in ahead.leaves[:k]]
    chain.draft_cached, chain.source = ahead.cached_len, DRAFT


def _can_draft(request: Request) -> bool:
    """A draft that reads target features needs them up to the history's second-last token (the
    target has fed everything but the last one)."""
    return request.features is None or request.features.rows >= len(request.history) - 1
