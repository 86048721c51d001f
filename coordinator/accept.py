"""Accepting a step's verdicts: each applied to its request's authoritative history, and counted.

The acceptance rule itself runs on the target (specbatch/engine/acceptance.py, by its verifier):
a verdict says how many drafts it kept, whether it kept a leaf, and the token after them. Here
the coordinator takes those tokens into the request (which streams them out), records how much of
the history each service now holds, stores the target's features for a draft that reads them,
and tallies what the step's StepStats report and what the k policy learns from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .chain import DRAFT, SHARED, Chain
from .proposers import kept
from .stats import StepStats


@dataclass
class Tally:
    """What one step's verdicts came to."""

    ks: list[int] = field(default_factory=list)  # the tokens each stepped sequence drafted
    outcomes: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) of the draft's chains
    lookup_outcomes: list[tuple[int, int]] = field(default_factory=list)  # and of the chains found by lookup
    shared_lookup_outcomes: list[tuple[int, int]] = field(default_factory=list)  # of those, in other requests' texts
    # At each rejected first draft that had leaves proposed: the rank of the target's token among
    # them (None: none of them).
    first_rejections: list[int | None] = field(default_factory=list)
    leaf_chances: int = 0  # first drafts rejected with leaves verified beside them
    leaf_hits: int = 0  # and of those, the ones where the target kept a leaf

    @classmethod
    def joined(cls, tallies: list["Tally"]) -> "Tally":
        """One step's tally from those of its parts (its target replicas' chains)."""
        whole = cls()
        for tally in tallies:
            for name, value in vars(tally).items():
                setattr(whole, name, getattr(whole, name) + value)
        return whole

    def stats(self, draft_seconds: float, target_seconds: float, step_seconds: float, draft_compute: float,
              target_compute: float) -> StepStats:
        return StepStats(len(self.ks), self.ks, self.outcomes, draft_seconds, target_seconds, step_seconds,
                         draft_compute, target_compute, self.leaf_chances, self.leaf_hits, self.lookup_outcomes,
                         self.shared_lookup_outcomes)


def accept(chains: list[Chain]) -> Tally:
    """Apply every verdict to its request; a chain without one (its target replica failed this
    step) changes nothing: it runs again once placed."""
    tally = Tally()
    for chain in chains:
        if chain.verdict is not None:
            _accept(chain, tally)
    return tally


def _accept(chain: Chain, tally: Tally) -> None:
    request, verdict, tokens = chain.request, chain.verdict, chain.tokens
    accepted = verdict.accepted
    leaf = [verdict.leaf] if verdict.HasField("leaf") else []
    if tokens and accepted == 0:
        offered = chain.next_best[0][: chain.leaves] if chain.next_best else []
        if chain.leaves and len(offered) == chain.leaves:  # the policy learns where the target's token ranked
            emitted = leaf[0] if leaf else verdict.next_token
            tally.first_rejections.append(offered.index(emitted) if emitted in offered else None)
        tally.leaf_chances += bool(chain.leaves_to_verify)
        tally.leaf_hits += len(leaf)
    before = len(request.history)
    if request.features is not None:  # the target fed (and kept) positions target_len …
        request.features.store(request.target_len, verdict.features)
    request.target_len = verdict.cached_len
    if tokens:
        # What the draft cached past the history is valid as far as its drafts were accepted
        # (a plain draft fed itself its first k-1 proposals; an EAGLE-style one keeps none).
        request.draft_len = min(chain.draft_cached, before + accepted)
    request.steps += 1
    request.proposed += len(tokens)
    request.accepted += accepted + len(leaf)
    request.take(tokens[:accepted] + leaf + [verdict.next_token])
    request.ahead = None
    if verdict.HasField("proposal"):  # the hosted draft drafted the next step after this verdict
        request.ahead, request.ahead_at = verdict.proposal, len(request.history)
        request.draft_len = verdict.proposal.cached_len
    tally.ks.append(len(tokens))
    if tokens:  # the chain's: what per-position acceptance counts
        outcome = (len(tokens), accepted)
        (tally.outcomes if chain.source == DRAFT else tally.lookup_outcomes).append(outcome)
        kept(request, chain.source, accepted)
        if chain.source == SHARED:
            tally.shared_lookup_outcomes.append(outcome)
