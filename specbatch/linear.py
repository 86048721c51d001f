"""Linear layers for the engine's own forward: weights prepared once, at load.

On a CPU with native bf16 (AVX512_BF16 or AMX), a bf16 weight reordered once into oneDNN's
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) multiplies a few rows at nearly the
cost of one: on SmolLM2's MLP shape 26 µs at 1 row and 28 µs at 5, where fp32 ``F.linear`` (MKL)
takes 76 µs and 200 µs (docs/engine.md). That flatness is what makes verifying k drafts cost
about one token's forward, which speculation needs. Elsewhere (fp32, GPUs) the weight is used
as it is with ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def onednn_bf16_available() -> bool:
    """True where the CPU multiplies bf16 natively (oneDNN's check: AVX512_BF16 or AMX)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear:
    """``x @ weight.T (+ bias)`` with the weight prepared once for the device and dtype.

    ``weight`` may be the concatenation of several layers' weights (fused QKV, fused gate/up):
    the output is then split by the caller.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        self.prepacked = weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and onednn_bf16_available()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None) if self.prepacked else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.prepacked:
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.weight, self.bias, "none", [None], "")
        return y.view(*shape[:-1], self.out_features)


def fused(*layers: torch.nn.Linear) -> PackedLinear:
    """One PackedLinear computing several linear layers that read the same input, side by side."""
    weight = torch.cat([layer.weight for layer in layers])
    biases = [layer.bias for layer in layers]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else torch.zeros(layer.out_features, dtype=weight.dtype, device=weight.device)
         for b, layer in zip(biases, layers)])
    return PackedLinear(weight, bias)
