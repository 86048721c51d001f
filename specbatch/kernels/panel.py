"""A linear layer on the kernels' matrix multiply: ``PanelLinear``, its weight packed once into panels
of output features (float32, bf16, bf16 dot products, float16 products, or GGUF's Q4_1 and Q8_0
blocks), read once at the memory's speed for every row of a call, each row summed in one fixed
order whatever the other rows are (so a row's bits never depend on them)."""

from __future__ import annotations

import ctypes
import math

import torch
import torch.nn.functional as F

from specbatch.kernels import build, pages

# Where each output feature of a panel lies among the panel's 16 bf16 at one k: the order in which
# panel_sgemm.c's LOAD_BF16 widens them back to features 0-15 (interleaving within 128-bit lanes).
BF16_PANEL_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)


class PanelLinear:
    """``x @ weight.T (+ bias)`` on the panel kernel; the weight packed once.

    ``weight`` may be the concatenation of several layers' weights (fused QKV, gate/up). In float32
    by default. ``bf16_weights``: the weight is kept rounded to bfloat16 (half the bytes a step
    reads) and multiplied with the float32 input in float32 (``panel_sgemm.c``). ``bf16_dot``: the
    weight in bfloat16 and each call's input rounded to bfloat16 too, products of pairs summed in
    float32 by AVX512_BF16's dot-product instruction (``panel_dpbf16.c``: half the arithmetic's
    cost again, so a verify step's rows ride along further). ``fp16_dot``: the weight in float16,
    each input row scaled by a power of two and rounded to float16, products summed in float16 in
    runs of 32 and the runs in float32 on AVX512_FP16 (``panel_fp16.c``: half the arithmetic of
    bf16 dot products on a CPU that has both, and closer to float32).
    ``q4_1``: the weight in GGUF's Q4_1 blocks (``specbatch.kernels.gguf_blocks``: the file's own
    values where the weight was dequantized from them), each input row quantized to Q8_1 blocks of
    its own, the products summed exactly in int32 on AVX512_VNNI or AVX2 (the same bits on both;
    ``panel_q4_1.c``: under a third of bf16's bytes; llama.cpp's arithmetic). ``q8_0``: the weight
    in GGUF's Q8_0 blocks and each input row quantized to Q8_0 blocks of its own, likewise
    (``panel_q8_0.c``: the embedded model's output head, as its file holds it, and a draft's layers).
    All are row-exact."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, bf16_weights: bool = False,
                 bf16_dot: bool = False, fp16_dot: bool = False, q4_1: bool = False, q8_0: bool = False):
        library = build._library()
        if library is None:
            raise RuntimeError(f"the panel kernel is unavailable: {build.unavailable_reason()}")
        if bf16_dot and not build.bf16_dot_available():
            raise RuntimeError("bf16 dot products need a CPU with AVX512_BF16 (and the kernels built for it)")
        if fp16_dot and not build.fp16_dot_available():
            raise RuntimeError("float16 products need a CPU with AVX512_FP16 (and the kernels built for it)")
        if (q4_1 or q8_0) and not build.blocks_available():
            raise RuntimeError(f"{'Q4_1' if q4_1 else 'Q8_0'} weights need the kernels built for AVX512_VNNI or for "
                               "AVX2 with F16C")
        if bf16_weights + bf16_dot + fp16_dot + q4_1 + q8_0 > 1:
            raise ValueError("ask for one of bf16_weights, bf16_dot, fp16_dot, q4_1 and q8_0")
        self.bf16_weights, self.bf16_dot, self.fp16_dot = bf16_weights, bf16_dot, fp16_dot
        self.q4_1, self.q8_0 = q4_1, q8_0
        # Which kernel reads the packed weight (decoder.c's FORM_* codes).
        self.form = (6 if q8_0 else 5 if q4_1 else 3 if fp16_dot else 2 if bf16_dot
                     else 1 if bf16_weights else 0)
        self.recovered_blocks = None  # the block forms': blocks already Q4_1 (Q8_0) (_init_q4_1, _init_q8_0)
        self.weight_unscale = 1.0  # the float16 form's power of two (_init_fp16)
        self._multiply = library.panel_linear_multiply
        if fp16_dot:
            self._init_fp16(weight, bias)
        elif q4_1:
            self._init_q4_1(weight, bias)
        elif q8_0:
            self._init_q8_0(weight, bias)
        else:
            self._init_panels(weight, bias)
        self.panels = pages.place(self.panels)
        # What the kernel reads of this layer (decoder.c's panel_linear), made once: the tensors it
        # points into live as long as the layer.
        self.args = _LinearArgs.of(self)

    def _init_panels(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """float32, bf16 weights and bf16 dot products: packed by panels of build.PANEL output features."""
        bf16_weights, bf16_dot = self.bf16_weights, self.bf16_dot
        weight = weight.detach().to(torch.bfloat16 if bf16_weights or bf16_dot else torch.float32)
        self.out_features, self.in_features = weight.shape
        padded = -self.out_features % build.PANEL
        weight = F.pad(weight, (0, 0, 0, padded))
        if bf16_dot:  # [panels, pairs of input features, build.PANEL, 2]: one pair of a panel is one 64-byte line
            weight = F.pad(weight, (0, self.in_features % 2))
            panels = weight.view(-1, build.PANEL, weight.shape[1] // 2, 2).transpose(1, 2)
        else:  # [panels, in_features, build.PANEL]: a panel's weights lie in the order the kernel reads them
            panels = weight.view(-1, build.PANEL, self.in_features).transpose(1, 2)
            if bf16_weights:
                panels = panels[..., list(BF16_PANEL_ORDER)]
        self.panels = panels.contiguous()
        # The kernel loads a panel's bias 16 at a time: padded so the last panel reads no further.
        self.bias = None if bias is None else F.pad(bias.detach().float(), (0, padded)).contiguous()

    def _init_fp16(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """The float16 form: the weight times a power of two that puts its largest |w| in [1, 2)
        (exact; panel_fp16.c's range argument), packed [panels, in_features, build.FP16_PANEL]."""
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        largest = float(weight.abs().max()) if weight.numel() else 0.0
        exponent = int(torch.frexp(torch.tensor(largest)).exponent) - 1 if largest > 0 else 0  # 2^e <= largest < 2^(e+1)
        self.weight_unscale = 2.0 ** exponent
        scaled = torch.ldexp(weight, torch.tensor(-exponent)).to(torch.float16)
        scaled = F.pad(scaled, (0, 0, 0, -self.out_features % build.FP16_PANEL))
        self.panels = scaled.view(-1, build.FP16_PANEL, self.in_features).transpose(1, 2).contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def _init_q4_1(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """The Q4_1 form: per panel of build.PANEL output features and block of 32 input features, 320
        bytes: four 64-byte lines of nibbles, then the features' d and m (float16), the order
        panel_q4_1.c unpacks them in (see there)."""
        from specbatch.kernels.gguf_blocks import BLOCK, q4_1_blocks

        blocks = q4_1_blocks(weight)
        self.out_features, self.in_features = weight.shape
        self.recovered_blocks = (blocks.recovered, blocks.blocks)
        padded = -self.out_features % build.PANEL
        values = F.pad(blocks.values, (0, 0, 0, 0, 0, padded))  # padding features: q = d = m = 0
        scale, minimum = F.pad(blocks.scale, (0, 0, 0, padded)), F.pad(blocks.minimum, (0, 0, 0, padded))
        panels, count = values.shape[0] // build.PANEL, self.in_features // BLOCK
        # Byte 4 f + t of line g: feature f's q of input feature 8 g + t (low nibble) and of 8 g + 4 + t
        # (high nibble), the unsigned operands of two vpdpbusd.
        q = values.view(panels, build.PANEL, count, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)  # [p, b, g, f, half, t]
        nibbles = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(panels, count, 256)
        self.panels = torch.cat([nibbles, _by_block(scale, count), _by_block(minimum, count)], dim=-1).contiguous()
        self.bias = None if bias is None else F.pad(bias.detach().float(), (0, padded)).contiguous()

    def _init_q8_0(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """The Q8_0 form: per panel of build.PANEL output features and block of 32 input features, 576
        bytes: eight 64-byte lines of int8 (line j: each feature's weights of input features 4 j to
        4 j + 3), then the features' d (float16) and their weights' sums (int16), the order
        panel_q8_0.c reads them in (see there)."""
        from specbatch.kernels.gguf_blocks import BLOCK, q8_0_blocks

        blocks = q8_0_blocks(weight)
        self.out_features, self.in_features = weight.shape
        self.recovered_blocks = (blocks.recovered, blocks.blocks)
        padded = -self.out_features % build.PANEL
        values = F.pad(blocks.values, (0, 0, 0, 0, 0, padded))  # padding features: q = d = 0
        scale = F.pad(blocks.scale, (0, 0, 0, padded))
        panels, count = values.shape[0] // build.PANEL, self.in_features // BLOCK
        # lines[p, b, j, f, t]: feature f's weight of input feature 4 j + t of block b.
        lines = values.view(panels, build.PANEL, count, BLOCK // 4, 4).permute(0, 2, 3, 1, 4)
        sums = values.to(torch.int32).sum(-1).to(torch.int16)  # |sum| <= 32 * 127
        self.panels = torch.cat([lines.reshape(panels, count, 512).view(torch.uint8), _by_block(scale, count),
                                 _by_block(sums, count)], dim=-1).contiguous()
        self.bias = None if bias is None else F.pad(bias.detach().float(), (0, padded)).contiguous()

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """``threads``: how many to split the panels among (default: torch's count)."""
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or rows.device.type != "cpu":
            raise TypeError(f"the panel kernel multiplies float32 CPU tensors, not {rows.dtype} on {rows.device}")
        rows = rows.contiguous()
        return self.multiply_at(rows.data_ptr(), shape[:-1], threads)

    def multiply_at(self, rows_at: int, shape: tuple[int, ...], threads: int | None = None) -> torch.Tensor:
        """``__call__`` on the float32 rows at address ``rows_at``, ``prod(shape)`` of them of
        ``in_features`` each, contiguous in host memory, for a caller that has them in place (the
        output head reading a forward's last columns, without a slice and a copy of them). Returns
        ``[*shape, out_features]``."""
        out = torch.empty(*shape, self.out_features)
        rows = math.prod(shape)
        if rows and self._multiply(ctypes.byref(self.args), rows_at, rows, out.data_ptr(),
                                   threads or torch.get_num_threads()):
            raise MemoryError("panel kernel: no memory for the input's rounded copy")
        return out


def _by_block(values: torch.Tensor, count: int) -> torch.Tensor:
    """A block form's 16-bit value per output feature and block, ``[features, count]`` (features
    padded to panels), as each panel's block stores them: ``[panel, block, 32 bytes]``."""
    return values.view(-1, build.PANEL, count).transpose(1, 2).contiguous().view(torch.uint8)


class _LinearArgs(ctypes.Structure):
    """decoder.c's panel_linear: one PanelLinear's packed weight and the kernel that reads it."""
    _fields_ = [("form", ctypes.c_int32), ("weight_unscale", ctypes.c_float), ("packed", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64)]

    @classmethod
    def of(cls, linear: PanelLinear) -> "_LinearArgs":
        def address(tensor: torch.Tensor | None):
            return None if tensor is None else tensor.data_ptr()

        return cls(linear.form, linear.weight_unscale, linear.panels.data_ptr(), address(linear.bias),
                   linear.in_features, linear.out_features)
