"""One request's part in one decode step, carried through it: how many tokens it may draft, the
chain of drafts a proposer found for it (and the draft's next-best tokens beside the first), and
the target's verdict on them."""

from __future__ import annotations

from dataclasses import dataclass, field

from specbatch.protocol.speculation import MAX_K
from specbatch.v1 import model_services_pb2 as services_pb

from .requests import Request

# Where a chain's drafts came from (``Chain.source``).
LOOKUP, SHARED, DRAFT = "lookup", "shared", "draft"


def room(request: Request, max_context: int) -> int:
    """The most tokens ``request`` may draft: each step yields accepted + 1 tokens, so no more than
    it can still use, and no more than its context holds."""
    return max(min(request.max_new_tokens - request.generated - 1, max_context - len(request.history) - 1, MAX_K), 0)


@dataclass(eq=False)
class Chain:
    request: Request
    k: int  # the most tokens it drafts this step (0: target-only)
    room: int  # the most any proposer may draft for it (``room``)
    probe: bool = False  # its k is a policy's probe: a step run to measure it, not the best known
    # What the policy allows beside a chain from the draft: next-best tokens the draft proposes at
    # the first drafted position, and how many of those the target verifies.
    leaves: int = 0
    verified_leaves: int = 0
    tokens: list[int] = field(default_factory=list)  # the drafts
    # Sampled requests: the q' each draft was drawn from (DraftDistribution messages, passed on to
    # the target as they came). Greedy: none.
    distributions: list = field(default_factory=list)
    source: str | None = None  # LOOKUP, SHARED or DRAFT; None: nothing drafted (target-only)
    next_best: list[list[int]] = field(default_factory=list)  # the draft's leaves, per drafted position
    draft_cached: int = 0  # tokens of the history the draft holds after proposing
    draft_read: int = 0  # tokens of the history the draft read before drafting (it had not cached them)
    # Where the draft is hosted in the target's process: the tokens it drafts for the next step
    # inside this step's Verify, after the verdict (0: none).
    next_k: int = 0
    # Its part in the Verify's further steps: (the tokens it may still generate, the positions its
    # context has left, its stop token ids); None: this step only.
    further: tuple[int, int, list[int]] | None = None
    verdict: object | None = None  # the target's (specbatch.v1.Verdict); None: its replica failed

    def found(self, tokens: list[int], source: str) -> None:
        """Drafts copied from text (prompt lookup): the draft service holds what it held, and a
        sampled request treats each token as drawn from a point mass (q(x) = 1)."""
        self.tokens, self.source, self.draft_cached = tokens, source, self.request.draft_len
        if not self.request.sampling.greedy:
            self.distributions = [services_pb.DraftDistribution(token_ids=[token], probs=[1.0]) for token in tokens]

    @property
    def leaves_to_verify(self) -> list[list[int]]:
        """The leaves the Verify carries: the first ``verified_leaves`` of the draft's next-best
        tokens at the first drafted position."""
        if not self.next_best or not self.verified_leaves:
            return []
        return [self.next_best[0][: self.verified_leaves]]

    @property
    def verify_width(self) -> int:
        """The drafts and leaves the target feeds for it beside its own tokens."""
        return len(self.tokens) + sum(len(at) for at in self.leaves_to_verify)
