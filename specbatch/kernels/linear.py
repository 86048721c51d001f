"""Linear layers for the engine's own forward: weights prepared once, at load.

On a CPU with native bf16 (AVX512_BF16 or AMX), a bf16 weight reordered once into oneDNN's
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) multiplies a few rows at nearly the
cost of one, where fp32 ``F.linear`` (MKL) grows with every row (docs/cpu-kernels.md). That
flatness is what makes verifying k drafts cost about one token's forward, which speculation needs.
A float32 weight is reordered for oneDNN too (on a CPU without native bf16 the engine runs fp32):
flatter than MKL's small-row sgemm, though not flat. On x86 CPUs with AVX2, float32 weights go to
the engine's own kernel instead (``specbatch.kernels.build``: flat up to five or six rows, and
faster than oneDNN); oneDNN is the fallback where it cannot be built. On GPUs the weight is used
as it is with ``F.linear``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specbatch.kernels import build
from specbatch.kernels.panel import PanelLinear


def onednn_bf16_available() -> bool:
    """True where the CPU multiplies bf16 natively (oneDNN's check: AVX512_BF16 or AMX)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


# Row counts at which a float32 oneDNN multiply must give each row exactly what it gives alone.
ROW_COUNTS_CHECKED = (2, 3, 5, 8, 17, 32, 64)


def onednn_fp32_rows_agree(out_features: int, in_features: int) -> bool:
    """Whether oneDNN's float32 multiply of this weight shape, on this CPU and thread count, gives
    every row bitwise what it gives that row alone, at each of ``ROW_COUNTS_CHECKED`` rows.
    Checked once per shape and thread count: oneDNN picks its kernel by both."""
    return _onednn_fp32_rows_agree(out_features, in_features, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _onednn_fp32_rows_agree(out_features: int, in_features: int, threads: int) -> bool:
    """``onednn_fp32_rows_agree`` at ``threads`` threads (the current count: part of the cache key).

    fp32 speculation is exact (greedy output equals target-only decoding) only if verifying k+1
    tokens computes each the same as one token a call. MKL's ``F.linear`` does not: it takes a
    matrix-vector kernel for one row and another for more, so most outputs differ in the last bits
    from the same rows one at a time. Whether oneDNN's agree depends on the CPU and the shape
    (docs/exactness.md), so each shape is checked, once."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    x = torch.randn(max(ROW_COUNTS_CHECKED), in_features, generator=generator)

    def multiply(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [None], "")

    with torch.inference_mode():
        return not any(differing_by_row_count(multiply, x, ROW_COUNTS_CHECKED).values())


def differing_by_row_count(multiply, x: torch.Tensor, row_counts) -> dict[int, float]:
    """For each m of ``row_counts``: the fraction of the outputs of ``multiply(x[:m])`` that differ
    bitwise from the same rows multiplied one at a time."""
    alone = torch.cat([multiply(x[i : i + 1]) for i in range(max(row_counts))])
    return {m: float((multiply(x[:m]) != alone[:m]).float().mean()) for m in row_counts}


def onednn_prepacks(weight: torch.Tensor) -> bool:
    """Whether a CPU weight is reordered once for oneDNN: in bf16 where the CPU multiplies bf16
    natively; in float32 wherever oneDNN is built in and its results do not depend on the row
    count (``onednn_fp32_rows_agree``): that makes fp32 speculation bitwise exact, which MKL's
    ``F.linear`` is not, and it grows less with the few rows of a verify step. oneDNN's fixed cost
    per call makes small weights slower (tiny test models); exactness is worth it."""
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.bfloat16:
        return onednn_bf16_available()
    return (weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and onednn_fp32_rows_agree(*weight.shape))


class PackedLinear:
    """``x @ weight.T (+ bias)`` with the weight prepared once for the device and dtype.

    ``weight`` may be the concatenation of several layers' weights (fused QKV, fused gate/up):
    the output is then split by the caller.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        self.prepacked = onednn_prepacks(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None) if self.prepacked else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.prepacked:
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.weight, self.bias, "none", [None], "")
        return y.view(*shape[:-1], self.out_features)


Linear = PackedLinear | PanelLinear


def panel_kernel_takes(weight: torch.Tensor) -> bool:
    """Whether a weight runs on the engine's own float32 kernel (``specbatch.kernels.build``): float32 on
    a CPU where it builds. Row-exact by construction, so no per-shape check is needed."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and build.available()


# Besides None (the weights as the model has them).
WEIGHT_FORMATS = ("bf16", "bf16-dot", "fp16-dot", "q4_1", "q8_0")


def linear(weight: torch.Tensor, bias: torch.Tensor | None = None, weights: str | None = None) -> Linear:
    """The engine's linear layer. ``weights``: None, as the model has them: float32 on a CPU on
    ``PanelLinear`` where it builds, else ``PackedLinear`` (oneDNN or ``F.linear``);
    "bf16": a float32 weight rounded to bfloat16 on the panel kernel (half the bytes a step reads,
    still row-exact); "bf16-dot": the weight and each input rounded to bfloat16, pairs' products
    summed in float32 on AVX512_BF16 (``build.bf16_dot_available``; row-exact too); "fp16-dot":
    the weight and each input (scaled by a power of two) rounded to float16, products summed in
    float16 in runs of 32, the runs in float32, on AVX512_FP16 (``build.fp16_dot_available``;
    row-exact); "q4_1":
    the weight in GGUF's Q4_1 blocks (``specbatch.kernels.gguf_blocks``: exactly the file's values where the
    weight came from them) and each input row quantized to Q8_1 blocks of its own, exact integer sums
    on AVX512_VNNI or AVX2 (row-exact, the same bits on both); "q8_0" (the q4_1 form's output head,
    and a draft's layers): the weight in GGUF's Q8_0 blocks and each input row quantized to Q8_0
    blocks of its own, likewise."""
    if weights in ("q4_1", "q8_0"):
        if not panel_kernel_takes(weight) or not build.blocks_available():
            raise ValueError(f"{weights} weights are for float32 weights on a CPU with AVX512_VNNI, or AVX2 with F16C, "
                             "where the panel kernel builds")
        return PanelLinear(weight, bias, q4_1=weights == "q4_1", q8_0=weights == "q8_0")
    if weights in ("bf16", "bf16-dot", "fp16-dot"):
        if not panel_kernel_takes(weight):
            raise ValueError(f"{weights} weights are for float32 weights on a CPU where the panel kernel builds")
        if weights == "bf16-dot" and not build.bf16_dot_available():
            raise ValueError("bf16-dot weights need a CPU with AVX512_BF16")
        if weights == "fp16-dot" and not build.fp16_dot_available():
            raise ValueError("fp16-dot weights need a CPU with AVX512_FP16")
        return PanelLinear(weight, bias, bf16_weights=weights == "bf16", bf16_dot=weights == "bf16-dot",
                                  fp16_dot=weights == "fp16-dot")
    if weights is not None:
        raise ValueError(f"unknown weight format {weights!r} (one of {WEIGHT_FORMATS} or None)")
    if panel_kernel_takes(weight):
        return PanelLinear(weight, bias)
    return PackedLinear(weight, bias)


def fused(*layers: torch.nn.Linear, weights: str | None = None) -> Linear:
    """One linear layer computing several that read the same input, side by side."""
    weight = torch.cat([layer.weight for layer in layers])
    biases = [layer.bias for layer in layers]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else torch.zeros(layer.out_features, dtype=weight.dtype, device=weight.device)
         for b, layer in zip(biases, layers)])
    return linear(weight, bias, weights)
