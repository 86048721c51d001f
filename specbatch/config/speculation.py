"""How the coordinator speculates: the one object its decode step is configured by (as vLLM's
``SpeculativeConfig``). Torch-free: the launcher and the coordinator's flags build it alike."""

from __future__ import annotations

from dataclasses import dataclass, replace

from specbatch.config.options import BY_DEST
from specbatch.protocol.speculation import (
    leaf_option_problems,
    prompt_lookup_problems,
    shared_lookup_problems,
    steps_per_call_problems,
)

# Leaves the goodput policies and learn may verify beside the first draft where none are asked for:
# they price each leaf's row against its live hit rate and take leaves only where they pay
# (docs/decisions/leaves.md). The other policies verify every leaf offered, so none by default.
POLICY_LEAVES = 3


def prices_leaves(policy: str) -> bool:
    """Whether ``policy`` verifies a leaf only where its row pays (the goodput policies, learn)."""
    return policy.startswith("goodput") or policy == "learn"


def default_k_policy(profile: str | None) -> str:
    """The k policy where none is asked for: goodput over a profile, else one that measures its own
    while serving (and starts from k = 0)."""
    return "goodput" if profile else "learn"


@dataclass(frozen=True)
class SpeculationConfig:
    # How k is chosen each step from the live batch size (coordinator/policy.py): fixed:K, or
    # profile, goodput and goodput:live over ``profile``, or learn (coordinator/learned.py).
    k_policy: str | None = None  # None: ``default_k_policy``
    profile: str | None = None  # the profile document (``specbatch profile``); re-read when it changes
    # The most of the draft's next-best tokens at the first drafted position verified beside the
    # chain; goodput and learn verify as many as pay, the other policies all. None: POLICY_LEAVES
    # under those, else 0.
    leaves: int | None = None
    # The most tokens drafted by copying what followed an earlier occurrence of the history's last
    # tokens, in place of a Propose (0: off).
    prompt_lookup: int = BY_DEST["prompt_lookup"].default
    # Tokens of finished requests' texts kept for lookup where a request's own history has no
    # match (0: off).
    shared_lookup: int = BY_DEST["shared_lookup"].default
    # While no request waits, up to this many decode steps in one Verify (its further steps) on a
    # target that runs them: the steps' tokens all come back, without a call per step.
    steps_per_call: int = BY_DEST["steps_per_call"].default

    @classmethod
    def from_args(cls, args) -> "SpeculationConfig":
        """From parsed flags (the coordinator's, or specbatch up's) or any object with the fields."""
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})

    def resolved(self) -> "SpeculationConfig":
        """The same with the policy and the leaves decided where they were left open."""
        policy = self.k_policy or default_k_policy(self.profile)
        leaves = self.leaves if self.leaves is not None else POLICY_LEAVES if prices_leaves(policy) else 0
        return replace(self, k_policy=policy, leaves=leaves)

    def problems(self) -> list[str]:
        """What is out of range, as messages (empty: none)."""
        return (leaf_option_problems(self.leaves) + prompt_lookup_problems(self.prompt_lookup)
                + shared_lookup_problems(self.shared_lookup) + steps_per_call_problems(self.steps_per_call))

    def check(self) -> "SpeculationConfig":
        if problems := self.problems():
            raise ValueError("; ".join(problems))
        return self
