"""Greedy exactness where a precision makes results depend on the batch's shape.

In float32 the engine's speculative output equals target-only decoding token for token, and the
tests say so. In bf16 a matrix multiply over more rows, or attention over a wider call, may round
differently (``row_dependence`` measures it), so a verify call over k+1 tokens can move a logit
by a rounding step. Greedy output may then differ from target-only decoding, but only where the
target's two best tokens are within rounding of each other. This module decodes the reference
(target-only, one token per call, exactly as the target service does it with no drafts) with the
gap between its two best logits at every position, and judges a speculative output against it:
the first position where they differ must be a near-tie, a gap below ``NEAR_TIE``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch

from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.kernels.linear import differing_by_row_count, linear

# The largest top-2 logit gap (in logits) at which a bf16 rounding difference may flip the greedy
# choice. A bf16 logit of magnitude 16-32 is rounded to a step of 0.125, and the difference in
# the hidden state before the head is itself a few bf16 steps: measured mismatches sit below it
# (docs/exactness.md has the distribution).
NEAR_TIE = 0.5


@dataclass
class Reference:
    tokens: list[int]
    gaps: list[float]  # top-1 minus top-2 logit where each token was chosen


def target_only(engine: Engine, prompt: list[int], max_new_tokens: int) -> Reference:
    """Greedy decoding with no drafts, one call per token: the prompt first, then each new token."""

    def decode() -> Reference:
        seq_id = f"reference-{uuid.uuid4().hex}"
        result = Reference([], [])
        kept, feed = 0, list(prompt)
        try:
            for _ in range(max_new_tokens):
                batch = engine.start([SequenceInput(seq_id, kept, feed)], create=kept == 0)
                logits = batch.prefill(1)[0, -1]
                top = logits.topk(2).values
                batch.commit([len(feed)])
                kept, feed = kept + len(feed), [int(logits.argmax())]
                result.tokens.append(feed[0])
                result.gaps.append(float(top[0] - top[1]))
        finally:
            engine.release([seq_id])
        return result

    return engine.run(decode)


@dataclass
class Mismatch:
    position: int  # index into the generated tokens of the first difference
    gap: float  # the reference's top-2 gap there

    @property
    def near_tie(self) -> bool:
        return self.gap < NEAR_TIE


def first_mismatch(tokens: list[int], reference: Reference) -> Mismatch | None:
    """Where ``tokens`` first leaves the reference (compared over their common length)."""
    for position, (mine, theirs) in enumerate(zip(tokens, reference.tokens)):
        if mine != theirs:
            return Mismatch(position, reference.gaps[position])
    return None


@torch.inference_mode()
def row_dependence(shapes: list[tuple[int, int]], rows: list[int], dtype=torch.bfloat16, seed: int = 0,
                   layer=linear) -> dict:
    """For each weight shape ``(out, in)``: the fraction of outputs of an M-row multiply (``layer``:
    by default the engine's own choice for the dtype, ``specbatch.kernels.linear.linear``) that differ
    bitwise from the same rows multiplied one at a time."""
    generator = torch.Generator().manual_seed(seed)
    result = {}
    for out_features, in_features in shapes:
        multiply = layer((torch.randn(out_features, in_features, generator=generator) * 0.05).to(dtype))
        x = torch.randn(max(rows), in_features, generator=generator).to(dtype)
        result[f"{out_features}x{in_features}"] = differing_by_row_count(multiply, x, rows)
    return result
