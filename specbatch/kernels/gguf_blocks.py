"""GGUF's Q4_1 and Q8_0 blocks of a float32 weight: each 32 input features of an output feature
hold ``w = d * q + m`` (Q4_1: q a 4-bit integer, d and m float16) or ``w = d * q`` (Q8_0: q an
int8 in [-127, 127], d float16); ``PanelLinear(q4_1=True)`` and ``PanelLinear(q8_0=True)`` read them.

The embedded target's layers are Q4_1 in its GGUF file, and transformers dequantizes them to
float32 as gguf-py does, ``float32(d) * q + float32(m)``. Those blocks are recovered here exactly
from the float32 weight: a block's smallest value is m (Q4_1 quantizes a block's minimum to q = 0)
and its largest m + 15 d, and a block counts as recovered only where d * q + m gives back every
one of its 32 values bit for bit. So on such a model the kernel multiplies by the file's own
weights. A block that is not Q4_1 already (another model) is quantized as llama.cpp's
``quantize_row_q4_1`` does it, which changes that model's weights. The embedded model's output
head (its tied embedding) is Q8_0 in the file: recovered the same way (a block's largest |w| is
127 d), other weights quantized as ``quantize_row_q8_0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # input features a block covers (GGUF's QK4_1 and QK8_0)


@dataclass
class Q4_1Blocks:
    scale: torch.Tensor  # d, [out_features, in_features / 32], float16
    minimum: torch.Tensor  # m, [out_features, in_features / 32], float16
    values: torch.Tensor  # q, [out_features, in_features / 32, 32], uint8 in 0..15
    recovered: int  # blocks whose float32 weights were d * q + m already (the rest quantized)

    @property
    def blocks(self) -> int:
        return self.scale.numel()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the blocks hold, computed as gguf-py does (d * q, then + m)."""
        d, m = self.scale.float()[..., None], self.minimum.float()[..., None]
        return (d * self.values.float() + m).reshape(self.values.shape[0], -1)


def q4_1_blocks(weight: torch.Tensor) -> Q4_1Blocks:
    """``weight`` [out_features, in_features] (in_features a multiple of 32) in Q4_1 blocks: recovered
    exactly where a block already is d * q + m (see the module docstring), quantized elsewhere."""
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"Q4_1 blocks cover {BLOCK} input features: {in_features} is not a multiple of {BLOCK}")
    w = weight.detach().float().reshape(out_features, in_features // BLOCK, BLOCK)
    low, high = w.amin(-1), w.amax(-1)
    # Recovery: m is the block's minimum, d its span over 15, both float16 in the file.
    minimum = low.to(torch.float16)
    scale = ((high - low) / 15).to(torch.float16)
    d, m = scale.float()[..., None], minimum.float()[..., None]
    steps = torch.where(d > 0, (w - m) / torch.where(d > 0, d, 1.0), 0.0).round().clamp(0, 15)
    recovered = ((d * steps + m) == w).all(-1) & torch.isfinite(w).all(-1)
    # Quantization of the rest, as quantize_row_q4_1: d = span / 15 in float32, q = trunc((x - min) / d + 0.5).
    span = (high - low) / 15
    inverse = torch.where(span > 0, 1 / torch.where(span > 0, span, 1.0), 0.0)
    quantized = ((w - low[..., None]) * inverse[..., None] + 0.5).floor().clamp(0, 15)
    values = torch.where(recovered[..., None], steps, quantized).to(torch.uint8)
    scale = torch.where(recovered, scale, span.to(torch.float16))
    return Q4_1Blocks(scale.contiguous(), minimum.contiguous(), values.contiguous(), int(recovered.sum()))


@dataclass
class Q8_0Blocks:
    scale: torch.Tensor  # d, [out_features, in_features / 32], float16
    values: torch.Tensor  # q, [out_features, in_features / 32, 32], int8 in -127..127
    recovered: int  # blocks whose float32 weights were d * q already (the rest quantized)

    @property
    def blocks(self) -> int:
        return self.scale.numel()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the blocks hold, computed as gguf-py does (d * q)."""
        return (self.scale.float()[..., None] * self.values.float()).reshape(self.values.shape[0], -1)


def q8_0_blocks(weight: torch.Tensor) -> Q8_0Blocks:
    """``weight`` [out_features, in_features] (in_features a multiple of 32) in Q8_0 blocks: recovered
    exactly where a block already is d * q (its largest |w| is 127 d, d float16 in the file),
    quantized elsewhere as llama.cpp's ``quantize_row_q8_0``: d = max|w| / 127, q = round(w / d)."""
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"Q8_0 blocks cover {BLOCK} input features: {in_features} is not a multiple of {BLOCK}")
    w = weight.detach().float().reshape(out_features, in_features // BLOCK, BLOCK)
    d = w.abs().amax(-1) / 127
    inverse = torch.where(d > 0, 1 / torch.where(d > 0, d, 1.0), 0.0)[..., None]
    # Recovery: d in float16 as the file has it, and each value a whole multiple of it.
    scale = d.to(torch.float16)
    steps = torch.where(scale.float()[..., None] > 0, w / scale.float().clamp(min=2**-24)[..., None], 0.0)
    steps = steps.round().clamp(-127, 127)
    recovered = ((scale.float()[..., None] * steps) == w).all(-1) & torch.isfinite(w).all(-1)
    # Quantization of the rest, as quantize_row_q8_0: q = round(w * (1 / d)), d stored in float16.
    quantized = (w * inverse).round().clamp(-127, 127)
    values = torch.where(recovered[..., None], steps, quantized).to(torch.int8)
    return Q8_0Blocks(scale.contiguous(), values.contiguous(), int(recovered.sum()))
