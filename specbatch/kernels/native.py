"""The engine's own float32 kernels for x86 CPUs, built on first use: a matrix multiply
(``panel_sgemm.c``; with bf16 dot products ``panel_dpbf16.c`` on AVX512_BF16, and there over
GGUF's Q4_1 blocks ``panel_q4_1.c``; with float16 products ``panel_fp16.c`` on AVX512_FP16),
attention (``attention.c``) and a layer's small operations between them (``layer_ops.c``:
residual add with RMS norm, rotary embedding with the KV write, SiLU-gated multiply) for the few
rows of a decode or verify step.

Why they exist is in the C files: at the few rows of a step the multiply reads the weights once,
at the memory's speed, for up to six rows, and attention and the small operations do their few
microseconds of arithmetic without PyTorch's per-operator set-up; and a row's result never depends
on the other rows of the call (the condition for bitwise-exact float32 speculation).
``specbatch.kernels.linear`` uses the multiply for float32 weights and ``specbatch.models.llama`` the rest for
float32 on a CPU, where they are available, and falls back to oneDNN, PyTorch's SDPA and its
operators where they are not.

The library is compiled with the system C compiler (``cc``; gcc or clang) into the cache
(``$SPECBATCH_CACHE/native``), keyed by a hash of the source and flags, and written by an atomic
rename, so processes starting together (the services) never load a half-written file. It links
OpenMP by the soname PyTorch's own runtime carries (``libgomp.so.1``), which torch has loaded by
then: the kernel's threads are torch's OpenMP threads, not a second team spinning beside them.

Off where: the CPU lacks AVX2 or FMA, no C compiler works, or ``SPECBATCH_NATIVE=0``; then
``available()`` is False and says why in ``unavailable_reason()``. ``python -m specbatch.kernels.native``
builds it ahead (the container image does, at build time).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from specbatch.kernels.cpu import c_compiler

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).parent / "c" / name
                for name in ("panel_blocks.c", "panel_sgemm.c", "panel_dpbf16.c", "panel_q4_1.c", "panel_fp16.c",
                             "panel_int8.c", "attention.c", "layer_ops.c", "decoder.c"))
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
# Where the CPU has AVX-512, the same code compiled for it: 32 vector registers instead of 16, so
# wider register blocks fit (panel_sgemm.c's BF16_PANELS). Part of the build's cache key.
AVX512_FLAGS = ("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq")
# Where the CPU has AVX512_BF16 besides: panel_dpbf16.c, bf16 dot products (compiled only then).
BF16_DOT_FLAGS = ("-mavx512bf16",)
# Where the CPU has AVX512_FP16 besides: panel_fp16.c, float16 products (compiled only then; a
# compiler without the flag (gcc < 12) builds the rest without it).
FP16_DOT_FLAGS = ("-mavx512fp16",)
# Where the CPU has AVX512_VNNI besides: panel_int8.c, int8 products summed exactly (a draft's
# layers; compiled only then).
INT8_DOT_FLAGS = ("-mavx512vnni",)
PANEL = 16  # output features a panel holds: panel_sgemm.c's PANEL
FP16_PANEL = 32  # panel_fp16.c's FP16_PANEL
HEAD_DIMS = (8, 16, 32, 64, 128)  # those attention.c is compiled for
# What the KV pool may hold for the kernels: rope_write writes and attend reads either.
KV_DTYPES = (torch.float32, torch.bfloat16)


def _cache_dir() -> Path:
    from specbatch.cache import cache_root

    return cache_root() / "native"


def _why_not() -> str | None:
    if os.environ.get("SPECBATCH_NATIVE", "1") == "0":
        return "SPECBATCH_NATIVE=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2/FMA (PyTorch sees {torch.backends.cpu.get_cpu_capability()})"
    if c_compiler() is None:
        return "no C compiler (cc, gcc or clang) to build it with"
    return None


def _cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists this CPU flag."""
    try:
        return f" {flag}" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def cpu_has_bf16_dot() -> bool:
    """Whether the CPU has AVX512_BF16's dot-product instruction."""
    return _cpu_has("avx512_bf16")


def cpu_has_vnni() -> bool:
    """Whether the CPU has AVX512_VNNI's int8 dot-product instruction."""
    return _cpu_has("avx512_vnni")


def cpu_has_fp16() -> bool:
    """Whether the CPU has AVX512_FP16's float16 arithmetic."""
    return _cpu_has("avx512_fp16")


def flags(fp16: bool = True) -> tuple[str, ...]:
    """The compiler flags for this CPU: ``FLAGS``, ``AVX512_FLAGS`` where PyTorch sees AVX-512, and
    with them ``BF16_DOT_FLAGS`` where the CPU has AVX512_BF16 and ``FP16_DOT_FLAGS`` where it has
    AVX512_FP16 (unless ``fp16`` is False)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return FLAGS
    return (FLAGS + AVX512_FLAGS + (BF16_DOT_FLAGS if cpu_has_bf16_dot() else ())
            + (INT8_DOT_FLAGS if cpu_has_vnni() else ()) + (FP16_DOT_FLAGS if fp16 and cpu_has_fp16() else ()))


def build(directory: Path | None = None, build_flags: tuple[str, ...] | None = None) -> Path:
    """The compiled library's path, compiling it first if the cache lacks this source's build
    (with ``build_flags``, default ``flags()``)."""
    compiler = c_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang)")
    source, build_flags = b"".join(path.read_bytes() for path in SOURCES), build_flags or flags()
    key = hashlib.sha256(source + " ".join(build_flags).encode()).hexdigest()[:16]
    directory = directory or _cache_dir()
    target = directory / f"specbatch-native-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / target.name
        try:
            result = subprocess.run([*compiler, *build_flags, *map(str, SOURCES), "-o", str(built)],
                                    capture_output=True, text=True)
        except OSError as error:  # $CC names no program
            raise RuntimeError(f"{' '.join(compiler)}: {error}") from error
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(compiler)} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a process loading it sees the whole file or none
    return target


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    reason = _why_not()
    if reason is not None:
        if reason != "SPECBATCH_NATIVE=0":
            log.warning("the float32 kernels are unavailable (%s): float32 linear layers run on oneDNN, "
                        "attention on PyTorch's SDPA", reason)
        return None
    try:
        try:
            library = ctypes.CDLL(str(build()))
        except RuntimeError as error:
            if flags(fp16=False) == flags():
                raise
            log.warning("the float16 multiply did not build (%s): building the kernels without it", error)
            library = ctypes.CDLL(str(build(build_flags=flags(fp16=False))))
    except (OSError, RuntimeError) as error:
        log.warning("the float32 kernels are unavailable (%s): float32 linear layers run on oneDNN, "
                    "attention on PyTorch's SDPA", error)
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    # Every form's multiply is reached through decoder.c's one entry, by a PanelLinear's _LinearArgs.
    library.panel_linear_multiply.argtypes = [pointer, pointer, size, pointer, ctypes.c_int]
    library.panel_linear_multiply.restype = ctypes.c_int
    library.attend.argtypes = [pointer, size, size, size, pointer, pointer, size, size, ctypes.c_int, pointer,
                               pointer, size, size, size, size, size, size, ctypes.c_float, ctypes.c_int]
    library.attend.restype = ctypes.c_int
    library.add_rms_norm.argtypes = [pointer, pointer, size, size, pointer, ctypes.c_float, pointer, ctypes.c_int]
    library.add_rms_norm.restype = None
    library.silu_mul.argtypes = [pointer, size, size, pointer, ctypes.c_int]
    library.silu_mul.restype = None
    library.rope_write.argtypes = [pointer, size, size, size, size, size, pointer, pointer, pointer, pointer,
                                   pointer, pointer, size, size, ctypes.c_int, ctypes.c_int]
    library.rope_write.restype = ctypes.c_int
    library.argmax_rows.argtypes = [pointer, size, size, pointer]
    library.argmax_rows.restype = None
    library.decoder_layers.argtypes = [pointer, size, size, pointer, size, size, size, size, size, pointer, pointer,
                                       pointer, pointer, pointer, size, size, size, size, ctypes.c_int, pointer, size,
                                       pointer, ctypes.c_float, pointer, ctypes.c_int]
    library.decoder_layers.restype = ctypes.c_int
    return library


def available() -> bool:
    """Whether the float32 kernels can run here (built on the first call)."""
    return _library() is not None


def bf16_dot_available() -> bool:
    """Whether the bf16 dot-product multiply (``panel_dpbf16.c``) runs here: the kernels built for a
    CPU with AVX512_BF16."""
    library = _library()
    return library is not None and hasattr(library, "panel_dpbf16")


def fp16_dot_available() -> bool:
    """Whether the float16 multiply (``panel_fp16.c``) runs here: the kernels built for a CPU with
    AVX512_FP16."""
    library = _library()
    return library is not None and hasattr(library, "panel_fp16")


def int8_dot_available() -> bool:
    """Whether the int8 multiply (``panel_int8.c``) runs here: the kernels built for a CPU with
    AVX512_VNNI."""
    library = _library()
    return library is not None and hasattr(library, "panel_int8")


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None where it is True)."""
    reason = _why_not()
    if reason is None and _library() is None:
        reason = "it failed to build or load (see the warning logged)"
    return reason


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
    bf16 dot products on a CPU that has both, and closer to float32). ``int8_dot``: the weight in
    int8 with a scale per output feature, each input row quantized to int8 with a scale of its
    own, the products summed exactly in int32 on AVX512_VNNI (``panel_int8.c``: a draft's layers).
    ``q4_1``: the weight in GGUF's Q4_1 blocks (``specbatch.kernels.gguf_blocks``: the file's own values where the
    weight was dequantized from them), each input rounded to bfloat16, on AVX512_BF16
    (``panel_q4_1.c``: under a third of bf16's bytes). All are row-exact."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, bf16_weights: bool = False,
                 bf16_dot: bool = False, fp16_dot: bool = False, int8_dot: bool = False, q4_1: bool = False):
        library = _library()
        if library is None:
            raise RuntimeError(f"the panel kernel is unavailable: {unavailable_reason()}")
        if bf16_dot and not bf16_dot_available():
            raise RuntimeError("bf16 dot products need a CPU with AVX512_BF16 (and the kernels built for it)")
        if fp16_dot and not fp16_dot_available():
            raise RuntimeError("float16 products need a CPU with AVX512_FP16 (and the kernels built for it)")
        if int8_dot and not int8_dot_available():
            raise RuntimeError("int8 products need a CPU with AVX512_VNNI (and the kernels built for it)")
        if q4_1 and not bf16_dot_available():
            raise RuntimeError("Q4_1 weights need a CPU with AVX512_BF16 (and the kernels built for it)")
        if bf16_weights + bf16_dot + fp16_dot + int8_dot + q4_1 > 1:
            raise ValueError("ask for one of bf16_weights, bf16_dot, fp16_dot, int8_dot and q4_1")
        self.bf16_weights, self.bf16_dot, self.fp16_dot, self.int8_dot = bf16_weights, bf16_dot, fp16_dot, int8_dot
        self.q4_1 = q4_1
        # Which kernel reads the packed weight (decoder.c's FORM_* codes).
        self.form = 5 if q4_1 else 4 if int8_dot else 3 if fp16_dot else 2 if bf16_dot else 1 if bf16_weights else 0
        self.recovered_blocks = None  # the Q4_1 form's: blocks that were Q4_1 already (_init_q4_1)
        self.weight_unscale = 1.0  # the float16 form's power of two (_init_fp16)
        self.weight_scale = self.weight_offset = None  # the int8 form's (_init_int8)
        self._multiply = library.panel_linear_multiply
        if fp16_dot:
            self._init_fp16(weight, bias)
        elif int8_dot:
            self._init_int8(weight, bias)
        elif q4_1:
            self._init_q4_1(weight, bias)
        else:
            self._init_panels(weight, bias)
        # What the kernel reads of this layer (decoder.c's panel_linear), made once: the tensors it
        # points into live as long as the layer.
        self.args = _LinearArgs.of(self)

    def _init_panels(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """float32, bf16 weights and bf16 dot products: packed by panels of PANEL output features."""
        bf16_weights, bf16_dot = self.bf16_weights, self.bf16_dot
        weight = weight.detach().to(torch.bfloat16 if bf16_weights or bf16_dot else torch.float32)
        self.out_features, self.in_features = weight.shape
        padded = -self.out_features % PANEL
        weight = F.pad(weight, (0, 0, 0, padded))
        if bf16_dot:  # [panels, pairs of input features, PANEL, 2]: one pair of a panel is one 64-byte line
            weight = F.pad(weight, (0, self.in_features % 2))
            panels = weight.view(-1, PANEL, weight.shape[1] // 2, 2).transpose(1, 2)
        else:  # [panels, in_features, PANEL]: a panel's weights lie in the order the kernel reads them
            panels = weight.view(-1, PANEL, self.in_features).transpose(1, 2)
            if bf16_weights:
                panels = panels[..., list(BF16_PANEL_ORDER)]
        self.panels = panels.contiguous()
        # The kernel loads a panel's bias 16 at a time: padded so the last panel reads no further.
        self.bias = None if bias is None else F.pad(bias.detach().float(), (0, padded)).contiguous()

    def _init_fp16(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """The float16 form: the weight times a power of two that puts its largest |w| in [1, 2)
        (exact; panel_fp16.c's range argument), packed [panels, in_features, FP16_PANEL]."""
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        largest = float(weight.abs().max()) if weight.numel() else 0.0
        exponent = int(torch.frexp(torch.tensor(largest)).exponent) - 1 if largest > 0 else 0  # 2^e <= largest < 2^(e+1)
        self.weight_unscale = 2.0 ** exponent
        scaled = torch.ldexp(weight, torch.tensor(-exponent)).to(torch.float16)
        scaled = F.pad(scaled, (0, 0, 0, -self.out_features % FP16_PANEL))
        self.panels = scaled.view(-1, FP16_PANEL, self.in_features).transpose(1, 2).contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def _init_int8(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """The int8 form: each output feature scaled to [-127, 127] and rounded, packed
        [panels, quads of input features, PANEL, 4]; its scale and 128 times its quantized sum
        (panel_int8.c's offset), padded to the panels' width."""
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        scale = weight.abs().amax(dim=1) / 127
        quantized = torch.where(scale[:, None] > 0, weight / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None],
                                torch.zeros_like(weight)).round().clamp(-127, 127).to(torch.int8)
        padded = -self.out_features % PANEL
        quantized = F.pad(quantized, (0, -self.in_features % 4, 0, padded))
        self.panels = quantized.view(-1, PANEL, quantized.shape[1] // 4, 4).transpose(1, 2).contiguous()
        self.weight_scale = F.pad(scale, (0, padded)).contiguous()
        self.weight_offset = (128 * quantized.to(torch.int32).sum(dim=1)).to(torch.int32).contiguous()
        self.bias = None if bias is None else F.pad(bias.detach().float(), (0, padded)).contiguous()

    def _init_q4_1(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """The Q4_1 form: per panel of PANEL output features and block of 32 input features, 320
        bytes: four 64-byte lines of nibbles, then the features' d and m (float16), the order
        panel_q4_1.c unpacks them in (see there)."""
        from specbatch.kernels.gguf_blocks import BLOCK, q4_1_blocks

        blocks = q4_1_blocks(weight)
        self.out_features, self.in_features = weight.shape
        self.recovered_blocks = (blocks.recovered, blocks.blocks)
        padded = -self.out_features % PANEL
        values = F.pad(blocks.values, (0, 0, 0, 0, 0, padded))  # padding features: q = d = m = 0
        scale, minimum = F.pad(blocks.scale, (0, 0, 0, padded)), F.pad(blocks.minimum, (0, 0, 0, padded))
        panels, count = values.shape[0] // PANEL, self.in_features // BLOCK
        # words[p, b, t, 2 f + j]: the weight of feature f, input feature 2 t + j of block b (t: the pair).
        words = values.view(panels, PANEL, count, BLOCK // 2, 2).permute(0, 2, 3, 1, 4).reshape(panels, count, 16, 32)
        # Line g of a block: 32 16-bit words; word w holds, from its low nibble up, word w of pairs
        # 4 g, 4 g + 1, 4 g + 2 and 4 g + 3 (the kernel takes each out with a shift and a mask).
        # Little-endian: the word's low byte holds pairs 4 g and 4 g + 1, its high byte the other two.
        quads = words.view(panels, count, 4, 4, 32)  # [panel, block, line, pair in line, word]
        low_byte, high_byte = quads[:, :, :, 0] | (quads[:, :, :, 1] << 4), quads[:, :, :, 2] | (quads[:, :, :, 3] << 4)
        nibbles = torch.stack([low_byte, high_byte], dim=-1).reshape(panels, count, 256)

        def by_block(half: torch.Tensor) -> torch.Tensor:  # [features, blocks] float16 -> [panel, block, 32 bytes]
            return half.view(panels, PANEL, count).transpose(1, 2).contiguous().view(torch.uint8)

        self.panels = torch.cat([nibbles, by_block(scale), by_block(minimum)], dim=-1).contiguous()
        self.bias = None if bias is None else F.pad(bias.detach().float(), (0, padded)).contiguous()

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """``threads``: how many to split the panels among (default: torch's count)."""
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or rows.device.type != "cpu":
            raise TypeError(f"the panel kernel multiplies float32 CPU tensors, not {rows.dtype} on {rows.device}")
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features)
        if rows.shape[0] and self._multiply(ctypes.byref(self.args), rows.data_ptr(), rows.shape[0], out.data_ptr(),
                                            threads or torch.get_num_threads()):
            raise MemoryError("panel kernel: no memory for the input's rounded copy")
        return out.view(*shape[:-1], self.out_features)


class _LinearArgs(ctypes.Structure):
    """decoder.c's panel_linear: one PanelLinear's packed weight and the kernel that reads it."""
    _fields_ = [("form", ctypes.c_int32), ("weight_unscale", ctypes.c_float), ("packed", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64),
                ("weight_scale", ctypes.c_void_p), ("weight_offset", ctypes.c_void_p)]

    @classmethod
    def of(cls, linear: PanelLinear) -> "_LinearArgs":
        def address(tensor: torch.Tensor | None):
            return None if tensor is None else tensor.data_ptr()

        return cls(linear.form, linear.weight_unscale, linear.panels.data_ptr(), address(linear.bias),
                   linear.in_features, linear.out_features, address(linear.weight_scale),
                   address(linear.weight_offset))


class _LayerArgs(ctypes.Structure):
    """decoder.c's decoder_layer."""
    _fields_ = [("qkv", _LinearArgs), ("o", _LinearArgs), ("gate_up", _LinearArgs), ("down", _LinearArgs),
                ("norm_in", ctypes.c_void_p), ("norm_post", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float)]


class DecoderLayers:
    """A Llama decoder's layers and final norm in one call (``decoder.c``): the kernels of
    ``specbatch.models.llama``'s layer loop, called in its order with its arguments, so the result is
    bitwise the loop's, without its ~9 Python calls a layer. ``layers``: per layer, its fused QKV,
    output, fused gate/up and down projections (``PanelLinear``, any form), its two norms' weights,
    their epsilon and the attention scale. The tensors are held here: the C side keeps pointers."""

    def __init__(self, layers: list[tuple], heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 final_norm: torch.Tensor, final_eps: float):
        self._library = _library()
        if self._library is None:
            raise RuntimeError(f"the kernels are unavailable: {unavailable_reason()}")
        hidden = layers[0][0].in_features
        for qkv, o, gate_up, down, norm_in, norm_post, _, _ in layers:
            _float32_rows("decoder layers", norm_in, norm_post)
            if ((qkv.in_features, qkv.out_features) != (hidden, (heads + 2 * kv_heads) * head_dim)
                    or (o.in_features, o.out_features) != (heads * head_dim, hidden)
                    or (gate_up.in_features, gate_up.out_features) != (hidden, 2 * intermediate)
                    or (down.in_features, down.out_features) != (intermediate, hidden)
                    or norm_in.shape != (hidden,) or norm_post.shape != (hidden,)):
                raise ValueError("decoder layers: every layer's projections and norms must fit one shape")
        _float32_rows("decoder layers", final_norm)
        self._held = (layers, final_norm)
        self.count, self.hidden = len(layers), hidden
        self.heads, self.kv_heads, self.head_dim, self.intermediate = heads, kv_heads, head_dim, intermediate
        self.final_norm, self.final_eps = final_norm, final_eps
        self._layers = (_LayerArgs * len(layers))(*[
            _LayerArgs(qkv.args, o.args, gate_up.args, down.args, norm_in.data_ptr(), norm_post.data_ptr(), eps, scale)
            for qkv, o, gate_up, down, norm_in, norm_post, eps, scale in layers])

    def __call__(self, x: torch.Tensor, rope: "Rope", attention: "Attention", kv: torch.Tensor,
                 threads: int | None = None) -> torch.Tensor:
        """x ``[batch, width, hidden]``, the embedded tokens (the residual stream, updated in place);
        ``rope`` and ``attention`` this forward's (positions, KV columns and angles; mask); kv
        ``[layers, 2, batch, kv_heads, columns, head_dim]`` (written in place); ``threads`` for
        every kernel (default: torch's count). Returns the final norm of the residual stream,
        ``[batch, width, hidden]``."""
        _float32_rows("decoder layers", x)
        batch, width = rope.batch, rope.width
        if (x.shape != (batch, width, self.hidden) or (attention.batch, attention.width) != (batch, width)
                or kv.dtype not in KV_DTYPES or kv.dim() != 6 or kv.shape[0] < self.count
                or kv.shape[1:4] != (2, batch, self.kv_heads) or kv.shape[5] != self.head_dim
                or kv.stride()[4:] != (self.head_dim, 1) or max(rope.last_column, attention.end - 1) >= kv.shape[4]
                or rope.cos.shape[1] != self.head_dim):
            raise ValueError("decoder layers: x, the positions, mask and KV pool (float32 or bfloat16) must match the "
                             "batch, the layers and their heads, with a column's elements contiguous and every "
                             "column within the pool")
        out = torch.empty_like(x)
        if self._library.decoder_layers(
                x.data_ptr(), batch, width, self._layers, self.count, self.heads, self.kv_heads, self.head_dim,
                self.intermediate, rope.positions.data_ptr(), rope.columns.data_ptr(), rope.cos.data_ptr(),
                rope.signed_sin.data_ptr(), kv.data_ptr(), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
                kv.dtype == torch.bfloat16, attention.seen.data_ptr(), attention.end, self.final_norm.data_ptr(),
                self.final_eps, out.data_ptr(), threads or torch.get_num_threads()):
            raise RuntimeError("decoder layers: a kernel refused its arguments, or memory ran out")
        return out


class Attention:
    """Attention over one forward's mask, ``[batch, 1, width, end]`` (True: may attend), for every
    layer of the forward (the mask is prepared once). Query head h reads key/value head
    h // (heads / kv_heads). Float32 CPU tensors (keys and values float32 or bfloat16), head_dim one
    of ``HEAD_DIMS``."""

    def __init__(self, mask: torch.Tensor):
        self.batch, _, self.width, self.end = mask.shape
        self.seen = mask.reshape(self.batch, self.width, self.end).contiguous().view(torch.uint8)
        self._attend = _library().attend

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """q ``[batch, heads, width, head_dim]``, keys and values ``[batch, kv_heads, end, head_dim]``
        with the same strides; returns ``[batch, width, heads * head_dim]``, the layout the output
        projection reads."""
        _, heads, _, head_dim = q.shape
        if (values.stride() != keys.stride() or q.shape[::2] != (self.batch, self.width) or keys.shape[2] != self.end
                or q.stride(-1) != 1 or keys.stride()[2:] != (head_dim, 1) or q.dtype != torch.float32
                or keys.dtype not in KV_DTYPES or values.dtype != keys.dtype):
            raise ValueError("attention: q (float32), keys and values (float32 or bfloat16, alike) must match the "
                             "mask, each head's columns lie contiguous, values share the keys' strides")
        out = torch.empty(self.batch, self.width, heads * head_dim)
        q_b, q_h, q_w, _ = q.stride()
        kv_b, kv_h, _, _ = keys.stride()
        if self._attend(q.data_ptr(), q_b, q_h, q_w, keys.data_ptr(), values.data_ptr(), kv_b, kv_h,
                        keys.dtype == torch.bfloat16, self.seen.data_ptr(), out.data_ptr(), self.batch, heads,
                        keys.shape[1], self.width, self.end, head_dim, scale, torch.get_num_threads()):
            raise MemoryError("attention: no scratch memory for the scores")
        return out


def _float32_rows(name: str, *tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"{name}: contiguous float32 CPU tensors only (got {tensor.dtype} on {tensor.device}, "
                             f"strides {tensor.stride()})")


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` in place (none: no add), then ``weight * x / sqrt(mean(x²) + eps)`` over the
    last dimension, returned as a new tensor: a decoder layer's residual add and the next RMS norm."""
    _float32_rows("add_rms_norm", x, weight, *([] if delta is None else [delta]))
    n = x.shape[-1]
    if weight.shape != (n,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, delta {None if delta is None else tuple(delta.shape)}, "
                         f"weight {tuple(weight.shape)}")
    out = torch.empty_like(x)
    _library().add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), x.numel() // n, n,
                            weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``, the same indices (the first of equal largest values; a row's first NaN where
    it has one), on the kernel for float32 CPU tensors: PyTorch's runs ~85 us a row over a 49152-token
    vocabulary, the kernel a few. Anything else (another dtype or device, no kernel) goes to
    PyTorch."""
    library = _library() if x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] else None
    if library is None:
        return x.argmax(-1)
    x = x.contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    library.argmax_rows(x.data_ptr(), out.numel(), x.shape[-1], out.data_ptr())
    return out


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``h = [..., gate | up]`` (a fused gate/up projection's output)."""
    _float32_rows("silu_mul", h)
    n = h.shape[-1] // 2
    out = torch.empty(*h.shape[:-1], n)
    _library().silu_mul(h.data_ptr(), h.numel() // (2 * n), n, out.data_ptr(), torch.get_num_threads())
    return out


class Rope:
    """The rotary embedding and KV write of one forward's tokens, for every layer of it: token
    (b, i) sits at ``positions[b, i]`` and writes its key and value into column
    ``columns[b, i]`` of the cache; its angles are that row of ``cos`` and ``signed_sin``
    ``[positions, head_dim]`` (sin with its first half negated)."""

    def __init__(self, positions: torch.Tensor, columns: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
        self.batch, self.width = positions.shape
        if columns.shape != positions.shape or int(positions.max()) >= cos.shape[0]:
            raise ValueError("rope: columns must match positions, and every position have a row of angles")
        self.positions = positions.to(torch.int64).contiguous()
        self.columns = columns.to(torch.int64).contiguous()
        self.last_column = int(self.columns.max())
        _float32_rows("rope", cos, signed_sin)
        self.cos, self.signed_sin = cos, signed_sin
        self._write = _library().rope_write

    def __call__(self, qkv: torch.Tensor, heads: int, kv_heads: int, keys: torch.Tensor,
                 values: torch.Tensor) -> torch.Tensor:
        """``qkv`` ``[batch, width, (heads + 2 kv_heads) * head_dim]``: rotated keys and the values
        are written into ``keys`` and ``values`` ``[batch, kv_heads, columns, head_dim]`` (the same
        strides and dtype, float32 or bfloat16 (rounded to nearest even); a column's head_dim
        elements contiguous); returns the rotated queries, ``[batch, heads, width, head_dim]``, a
        view into ``qkv`` (rotated in place)."""
        head_dim = self.cos.shape[1]
        _float32_rows("rope", qkv)
        if (qkv.shape != (self.batch, self.width, (heads + 2 * kv_heads) * head_dim) or keys.stride() != values.stride()
                or keys.shape[:2] != (self.batch, kv_heads) or keys.shape[3] != head_dim
                or keys.stride()[2:] != (head_dim, 1) or self.last_column >= keys.shape[2]
                or keys.dtype not in KV_DTYPES or values.dtype != keys.dtype):
            raise ValueError("rope: qkv must match the positions and head counts, keys and values (float32 or "
                             "bfloat16, alike) the batch and head_dim with a column's elements contiguous, every "
                             "column within them")
        if self._write(qkv.data_ptr(), self.batch, self.width, heads, kv_heads, head_dim, self.positions.data_ptr(),
                       self.columns.data_ptr(), self.cos.data_ptr(), self.signed_sin.data_ptr(), keys.data_ptr(),
                       values.data_ptr(), keys.stride(0), keys.stride(1), keys.dtype == torch.bfloat16,
                       torch.get_num_threads()):
            raise ValueError(f"rope: head_dim must be even and at most 256 (got {head_dim})")
        return qkv[..., : heads * head_dim].view(self.batch, self.width, heads, head_dim).transpose(1, 2)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    reason = _why_not()
    if reason:
        print(f"not built: {reason}")
    else:
        print(build())
