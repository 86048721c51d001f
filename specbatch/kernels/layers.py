"""The kernels beside the multiply, for the few rows of a decode or verify step: a forward's decoder
layers in one C call, attention over a batch's own pool columns, rotary embedding with the KV
write, residual add with RMS norm, the SiLU-gated multiply and a row's argmax. Each is bitwise
what the PyTorch operators it replaces compute (the tests say so), without their per-operator
set-up."""

from __future__ import annotations

import ctypes
import math
from array import array

import torch

from specbatch.kernels import build
from specbatch.kernels.panel import PanelLinear, _LinearArgs

HEAD_DIMS = (8, 16, 32, 64, 128)  # those attention.c is compiled for


# What the KV pool may hold for the kernels: rope_write writes and attend reads either.
KV_DTYPES = (torch.float32, torch.bfloat16)


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
        self._library = build._library()
        if self._library is None:
            raise RuntimeError(f"the kernels are unavailable: {build.unavailable_reason()}")
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
        if x.shape != (rope.batch, rope.width, self.hidden):
            raise ValueError("decoder layers: x must match the positions and the hidden size")
        self._check(rope, attention, kv)
        out = torch.empty_like(x)
        if self._library.decoder_layers(
                x.data_ptr(), rope.batch, rope.width, self._layers, self.count, self.heads, self.kv_heads,
                self.head_dim, self.intermediate, rope.positions_at, rope.columns_at,
                rope.cos.data_ptr(), rope.signed_sin.data_ptr(), kv.data_ptr(), kv.stride(0), kv.stride(1),
                kv.stride(2), kv.stride(3), kv.dtype == torch.bfloat16, attention.seen_at, attention.end,
                self.final_norm.data_ptr(), self.final_eps, out.data_ptr(), threads or torch.get_num_threads()):
            raise RuntimeError("decoder layers: a kernel refused its arguments, or memory ran out")
        return out

    def _check(self, rope: Rope, attention: Attention, kv: torch.Tensor) -> None:
        batch, width = rope.batch, rope.width
        if ((attention.batch, attention.width) != (batch, width)
                or kv.dtype not in KV_DTYPES or kv.dim() != 6 or kv.shape[0] < self.count
                or kv.shape[1:4] != (2, batch, self.kv_heads) or kv.shape[5] != self.head_dim
                or kv.stride()[4:] != (self.head_dim, 1) or max(rope.last_column, attention.end - 1) >= kv.shape[4]
                or rope.cos.shape[1] != self.head_dim):
            raise ValueError("decoder layers: the positions, mask and KV pool (float32 or bfloat16) must match the "
                             "batch, the layers and their heads, with a column's elements contiguous and every "
                             "column within the pool")

    def draft_chain(self, embed: torch.Tensor, fuse: PanelLinear | None, input_ids: array,
                    features: torch.Tensor | None, rope: Rope, attention: Attention, kv: torch.Tensor,
                    next_positions: list[int], steps: int, head: PanelLinear, to_token: torch.Tensor | None,
                    threads: int | None = None, first_logits: bool = False
                    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """A greedy draft's tokens in one call (``decoder.c``'s draft_chain): this forward's fed
        tokens (``input_ids``, ``array("q")`` ``[batch, width]`` row-major, embedded from ``embed``,
        fused with ``features`` where ``fuse`` is given, at ``rope``'s positions and columns under
        ``attention``'s mask), then ``steps`` tokens a row, each fed at ``next_positions[row]`` plus
        those drafted before it with the final hidden state before it as its feature; each token the
        ``head``'s argmax (through ``to_token``). Bitwise the tokens of calling this object, the
        fusing layer and the head a forward at a time. Returns each row's ``steps + 1`` token ids
        (lists: the caller wants them in Python), and with ``first_logits`` the head's logits at
        each row's first drafted token (else None)."""
        batch, width = rope.batch, rope.width
        hidden = self.hidden
        _float32_rows("draft chain", embed)
        if (not isinstance(input_ids, array) or input_ids.typecode != "q" or len(input_ids) != batch * width
                or embed.shape[1] != hidden or head.in_features != hidden or len(next_positions) != batch
                or (fuse is not None and (fuse.in_features, fuse.out_features) != (2 * hidden, hidden))
                or (fuse is not None and (features is None or features.shape != (batch, width, hidden)))
                or (to_token is not None and (to_token.dtype != torch.int64 or to_token.shape != (head.out_features,)
                                              or to_token.device.type != "cpu" or not to_token.is_contiguous()))
                or steps < 0 or max(next_positions) + steps > min(kv.shape[4] - 1, rope.cos.shape[0])):
            raise ValueError("draft chain: the tokens (int64), features, embedding, fusing layer and head must match "
                             "the batch and the hidden size, every drafted token fit the pool and the angles")
        if fuse is not None:
            _float32_rows("draft chain", features)
        self._check(rope, attention, kv)
        tokens = (ctypes.c_int64 * (batch * (steps + 1)))()
        logits = torch.empty(batch, head.out_features) if first_logits else None
        at = array("q", next_positions)
        if self._library.draft_chain(
                embed.data_ptr(), None if fuse is None else ctypes.byref(fuse.args), input_ids.buffer_info()[0],
                None if fuse is None else features.data_ptr(), batch, width, self._layers, self.count, self.heads,
                self.kv_heads, self.head_dim, self.intermediate, rope.positions_at, rope.columns_at,
                attention.seen_at, attention.end, at.buffer_info()[0], steps, rope.cos.data_ptr(),
                rope.signed_sin.data_ptr(), kv.data_ptr(), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
                kv.dtype == torch.bfloat16, self.final_norm.data_ptr(), self.final_eps, ctypes.byref(head.args),
                None if to_token is None else to_token.data_ptr(), ctypes.addressof(tokens),
                None if logits is None else logits.data_ptr(), threads or torch.get_num_threads()):
            raise RuntimeError("draft chain: a kernel refused its arguments, or memory ran out")
        flat, row = tokens[:], steps + 1
        return [flat[r * row : (r + 1) * row] for r in range(batch)], logits


class Attention:
    """Attention over one forward's mask, ``[batch, 1, width, end]`` (True: may attend), for every
    layer of the forward (the mask is prepared once). Query head h reads key/value head
    h // (heads / kv_heads). Float32 CPU tensors (keys and values float32 or bfloat16), head_dim one
    of ``HEAD_DIMS``."""

    def __init__(self, mask: torch.Tensor):
        batch, _, width, end = mask.shape
        self._hold(batch, width, end, mask.reshape(batch, width, end).contiguous().view(torch.uint8))

    @classmethod
    def of_bytes(cls, batch: int, width: int, end: int, seen: array) -> Attention:
        """The same from the mask as bytes, ``array("B")`` ``[batch, width, end]`` row-major (1: may
        attend), as ``specbatch.engine.batch.HostIndices`` builds it: read where it lies."""
        if seen.typecode != "B" or len(seen) != batch * width * end:
            raise ValueError("attention: the mask's bytes must be batch x width x end")
        attention = cls.__new__(cls)
        attention._hold(batch, width, end, seen)
        return attention

    def _hold(self, batch: int, width: int, end: int, seen: torch.Tensor | array) -> None:
        self.batch, self.width, self.end = batch, width, end
        self.seen = seen  # held while the kernels read it at seen_at
        self.seen_at = seen.data_ptr() if isinstance(seen, torch.Tensor) else seen.buffer_info()[0]
        self._attend = build._library().attend

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
                        keys.dtype == torch.bfloat16, self.seen_at, out.data_ptr(), self.batch, heads,
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
    build._library().add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), x.numel() // n, n,
                            weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``, the same indices (the first of equal largest values; a row's first NaN where
    it has one), on the kernel for float32 CPU tensors, a small fraction of PyTorch's cost over a
    large vocabulary. Anything else (another dtype or device, no kernel) goes to PyTorch."""
    library = build._library() if x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] else None
    if library is None:
        return x.argmax(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    library.argmax_rows(x.data_ptr(), out.numel(), x.shape[-1], out.data_ptr())
    return out


def argmax_list(x: torch.Tensor) -> list:
    """``argmax(x).tolist()``: on the kernel (float32 CPU tensors) straight into Python ints,
    without the index tensor (a step's few rows, whose every tensor operation costs more than
    the argmax)."""
    library = build._library() if x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] else None
    if library is None or x.dim() < 2 or not x.numel():
        return argmax(x).tolist()
    if not x.is_contiguous():
        x = x.contiguous()
    *lead, size = x.shape
    out = (ctypes.c_int64 * math.prod(lead))()
    library.argmax_rows(x.data_ptr(), len(out), size, ctypes.addressof(out))
    rows = out[:]
    for count in reversed(lead[1:]):  # nested as tolist() nests them
        rows = [rows[i : i + count] for i in range(0, len(rows), count)]
    return rows


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``h = [..., gate | up]`` (a fused gate/up projection's output)."""
    _float32_rows("silu_mul", h)
    n = h.shape[-1] // 2
    out = torch.empty(*h.shape[:-1], n)
    build._library().silu_mul(h.data_ptr(), h.numel() // (2 * n), n, out.data_ptr(), torch.get_num_threads())
    return out


class Rope:
    """The rotary embedding and KV write of one forward's tokens, for every layer of it: token
    (b, i) sits at ``positions[b, i]`` and writes its key and value into column
    ``columns[b, i]`` of the cache; its angles are that row of ``cos`` and ``signed_sin``
    ``[positions, head_dim]`` (sin with its first half negated)."""

    def __init__(self, positions: torch.Tensor, columns: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
        batch, width = positions.shape
        if columns.shape != positions.shape or int(positions.max()) >= cos.shape[0]:
            raise ValueError("rope: columns must match positions, and every position have a row of angles")
        positions, columns = positions.to(torch.int64).contiguous(), columns.to(torch.int64).contiguous()
        self._hold(batch, width, positions, positions.data_ptr(), columns, columns.data_ptr(), int(columns.max()),
                   cos, signed_sin)

    @classmethod
    def of_arrays(cls, batch: int, width: int, positions: array, columns: array, cos: torch.Tensor,
                  signed_sin: torch.Tensor) -> Rope:
        """The same from ``array("q")``s ``[batch, width]`` row-major, as
        ``specbatch.engine.batch.HostIndices`` builds them: read where they lie."""
        if (positions.typecode != "q" or columns.typecode != "q" or len(positions) != batch * width
                or len(columns) != len(positions) or max(positions) >= cos.shape[0]):
            raise ValueError("rope: columns must match positions, and every position have a row of angles")
        rope = cls.__new__(cls)
        rope._hold(batch, width, positions, positions.buffer_info()[0], columns, columns.buffer_info()[0],
                   max(columns), cos, signed_sin)
        return rope

    def _hold(self, batch: int, width: int, positions, positions_at: int, columns, columns_at: int,
              last_column: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        self.batch, self.width = batch, width
        # The int64 buffers (tensors or arrays), held while the kernels read them at these addresses.
        self.positions, self.columns, self.positions_at, self.columns_at = positions, columns, positions_at, columns_at
        self.last_column = last_column
        _float32_rows("rope", cos, signed_sin)
        self.cos, self.signed_sin = cos, signed_sin
        self._write = build._library().rope_write

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
        if self._write(qkv.data_ptr(), self.batch, self.width, heads, kv_heads, head_dim, self.positions_at,
                       self.columns_at, self.cos.data_ptr(), self.signed_sin.data_ptr(), keys.data_ptr(),
                       values.data_ptr(), keys.stride(0), keys.stride(1), keys.dtype == torch.bfloat16,
                       torch.get_num_threads()):
            raise ValueError(f"rope: head_dim must be even and at most 256 (got {head_dim})")
        return qkv[..., : heads * head_dim].view(self.batch, self.width, heads, head_dim).transpose(1, 2)
