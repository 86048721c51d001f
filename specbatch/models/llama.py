"""The engine's own forward for Llama-family models (and the EAGLE-style draft), over its KV pool.

transformers' forward spends most of a one-token CPU step outside the matrix multiplies: cache
objects, mask builders, attention dispatch and a scatter per layer (docs/cpu-kernels.md).
This forward does the same arithmetic as ``LlamaForCausalLM`` in as few operations as it can:
fused QKV and gate/up projections with weights prepared once (``specbatch.kernels.linear``), new
keys/values written straight into the pool with one indexed copy, and one SDPA call per layer
over the rows' own pool columns with the engine's 4D mask. The parameters stay the model's own;
only the projections are repacked.

OPT models have their own (``specbatch.models.opt``); others run through transformers
(``specbatch.models.transformers_forward``).
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specbatch.kernels import build
from specbatch.kernels import layers as kernel_layers
from specbatch.kernels.layers import HEAD_DIMS, Attention, DecoderLayers, Rope
from specbatch.kernels.linear import fused, linear
from specbatch.kernels.panel import PanelLinear
from specbatch.models.eagle import reads_target_features

if TYPE_CHECKING:
    from specbatch.engine.batch import HostIndices

# Architectures whose decoder layers are LlamaDecoderLayer as this forward computes them.
SUPPORTED_MODEL_TYPES = ("llama", "specbatch_eagle")


def supports(model) -> bool:
    config = model.config
    # A target returning fused features (eagle.fuse_target_features) wraps its final norm: the
    # transformers forward computes those.
    return (getattr(config, "model_type", None) in SUPPORTED_MODEL_TYPES and config.hidden_act == "silu"
            and getattr(config, "pretraining_tp", 1) == 1 and not getattr(config, "feature_layers", None))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As LlamaRMSNorm (bitwise, in float32 and bf16): normalised in float32 (PyTorch's rms_norm
    # computes a bf16 input in float32 and rounds once, as LlamaRMSNorm's .to() does), scaled in
    # the model's dtype; two operators where LlamaRMSNorm takes seven.
    return weight * F.rms_norm(x, x.shape[-1:], eps=eps)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated, for ``_rotate``."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # RoPE as LlamaForCausalLM applies it, x * cos + rotate_half(x) * sin, where rotate_half(x)
    # = cat(-x2, x1): rolling x by half a head and negating sin's first half instead gives the
    # same products bit for bit (negation is exact) in four operators rather than eight.
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


# A layer's small operations in PyTorch operators, with the signatures of specbatch.kernels.build's
# (which the forward uses instead for float32 on a CPU where they build).

def _add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` in place (the residual stream), then the RMS norm of x."""
    if delta is not None:
        x += delta
    return _rms_norm(x, weight, eps)


def _silu_mul(h: torch.Tensor) -> torch.Tensor:
    n = h.shape[-1] // 2
    return F.silu(h[..., :n]) * h[..., n:]


class _TorchRope:
    """``Rope``'s contract in PyTorch operators: rotates a forward's queries and keys
    (angles computed for its positions) and writes keys and values into the cache; returns the
    queries ``[batch, heads, width, head_dim]``."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, write_columns: torch.Tensor):
        self.cos, self.signed_sin = cos[:, None], _signed_sin(sin[:, None])
        self.columns = write_columns
        self.rows = torch.arange(write_columns.shape[0], device=write_columns.device)[:, None]

    def __call__(self, qkv, heads: int, kv_heads: int, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        batch, width, _ = qkv.shape
        hd = self.cos.shape[-1]
        qk, v = qkv.split(((heads + kv_heads) * hd, kv_heads * hd), dim=-1)
        # Queries and keys rotated in one go: heads side by side, the same positions.
        q, k = _rotate(qk.view(batch, width, -1, hd).transpose(1, 2), self.cos, self.signed_sin).split(
            (heads, kv_heads), dim=1)
        keys[self.rows, :, self.columns] = k.transpose(1, 2)
        values[self.rows, :, self.columns] = v.view(batch, width, -1, hd)
        return q


class _Layer:
    def __init__(self, layer, weights: str | None):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = fused(attn.q_proj, attn.k_proj, attn.v_proj, weights=weights)
        self.o = linear(attn.o_proj.weight, attn.o_proj.bias, weights)
        self.gate_up = fused(mlp.gate_proj, mlp.up_proj, weights=weights)
        self.down = linear(mlp.down_proj.weight, mlp.down_proj.bias, weights)
        self.norm_in, self.norm_post = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.variance_epsilon
        self.head_dim = attn.head_dim
        self.q_size = attn.q_proj.out_features
        self.kv_size = attn.k_proj.out_features
        self.intermediate = mlp.gate_proj.out_features
        self.scaling = attn.scaling


class LlamaForward:
    """``__call__`` runs one ragged batch: see ``specbatch.engine.batch.RaggedBatch`` for the layout.
    ``weights``: how the linear layers keep their weights (``specbatch.kernels.linear.linear``): None, as
    the model has them; "bf16", rounded to bfloat16 for a float32 forward; "bf16-dot", the weights
    and the layers' inputs rounded to bfloat16 for a float32 forward; "fp16-dot", to float16 with
    float16 products; "q4_1", the decoder layers' weights in GGUF's Q4_1 blocks, the output head
    in its Q8_0 blocks, the inputs of both quantized to 8 bits as llama.cpp does; "q8_0" (the
    embedded draft's), every weight in Q8_0 blocks."""

    def __init__(self, model, weights: str | None = None):
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not a Llama-family model this forward covers")
        base = model.get_decoder()
        self.embed = base.embed_tokens.weight
        # The EAGLE draft's fusing layer keeps float32 inputs under ``q8_0`` (its weights in bf16):
        # it reads the target's raw hidden states, whose few huge features leave an input quantized
        # to 8 bits little resolution for the rest: 8 bits there cost many accepted tokens a step,
        # 8 bits everywhere else and bf16 weights here next to none (docs/decisions/q8_0-draft.md).
        self.fuse = (linear(base.fc.weight, None, "bf16" if weights == "q8_0" else weights)
                     if reads_target_features(model) else None)
        self.rotary = base.rotary_emb
        self.layers = [_Layer(layer, weights) for layer in base.layers]
        self.norm, self.eps = base.norm.weight, base.norm.variance_epsilon
        # Under "q4_1" the head is Q8_0, as the embedded GGUF holds it (256 levels a block, which 4-bit
        # blocks would coarsen): the file's own weights in under 60 % of bf16's bytes.
        self.head = linear(model.get_output_embeddings().weight, None, "q8_0" if weights == "q4_1" else weights)
        # PyTorch's CPU SDPA in bf16 is slow with one query row per head: folding the query heads
        # of each KV head into one head of as many query rows makes it several times faster. In
        # fp32 folding is slower.
        fold = self.embed.device.type == "cpu" and self.embed.dtype != torch.float32
        # Query heads folded into each key/value head's SDPA call (1: none).
        self.folded_groups = self.layers[0].q_size // self.layers[0].kv_size if fold else 1
        # In float32 on a CPU, attention runs on the engine's own kernel (specbatch.kernels.build): SDPA
        # spends most of a step's few query rows setting up its tiled kernel, and a row's result
        # must not depend on the other rows (float32 speculation is bitwise exact). At every width,
        # prompts included: SDPA's result for a prompt's rows depends on the call's width (a prompt
        # prefilled beside a longer one moved logits enough to leave target-only decoding at
        # near-ties: docs/exactness.md), and the kernel is no slower at a prompt's width.
        self.native_attention = (self.embed.device.type == "cpu" and self.embed.dtype == torch.float32
                                 and self.layers[0].head_dim in HEAD_DIMS and build.available())
        # And the small operations between the multiplies (norms, rotary embedding with the KV
        # write, SiLU): ~25 PyTorch operators a layer, a few microseconds of arithmetic each at a
        # step's few rows but several times that in dispatch and set-up. At every width, so that a
        # token's keys and values come out of the same arithmetic however it was fed. Rotary angles
        # come from a table of every position, which needs frequencies fixed up front (not
        # "dynamic" RoPE).
        self.native_layer_ops = (self.native_attention
                                 and getattr(self.rotary, "rope_type", "default") not in ("dynamic", "longrope"))
        self._angles: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, signed sin) [positions, head_dim]
        # And the whole layer loop in one C call where every projection is on the panel kernel: the
        # same kernels in the same order, bitwise the loop below, without its ~9 Python calls a layer
        # (a large share of a one-token step: docs/cpu-kernels.md). None: the loop runs in Python.
        self.decoder_layers = self._native_decoder_layers() if self.native_layer_ops else None
        # Calls of at least wide_from_rows rows run the layers in one call, and the output head, on
        # wide_threads threads (0: the process's count; specbatch.engine.engine.Engine sets them).
        self.wide_threads, self.wide_from_rows = 0, 1
        self._x: torch.Tensor | None = None  # on_host's embedded tokens (_embedded)

    def _native_decoder_layers(self) -> DecoderLayers | None:
        layers = self.layers
        first = layers[0]
        if not all(isinstance(linear, PanelLinear)
                   for layer in layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)):
            return None  # projections on oneDNN, say
        if any((layer.head_dim, layer.q_size, layer.kv_size, layer.intermediate)
               != (first.head_dim, first.q_size, first.kv_size, first.intermediate) for layer in layers):
            return None
        return DecoderLayers(
            [(layer.qkv, layer.o, layer.gate_up, layer.down, layer.norm_in, layer.norm_post, layer.eps, layer.scaling)
             for layer in layers],
            first.q_size // first.head_dim, first.kv_size // first.head_dim, first.head_dim, first.intermediate,
            self.norm, self.eps)

    def _angle_table(self, last_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for every position up to ``last_position``, grown by doubling.
        Row p is bitwise the model's own rotary embedding at position p: its angles are products of
        one frequency and one position, elementwise, whatever positions are computed beside."""
        needed = last_position + 1
        if self._angles is None or self._angles[0].shape[0] < needed:
            length = max(needed, 1024, 2 * (0 if self._angles is None else self._angles[0].shape[0]))
            cos, sin = self.rotary(self.embed[:1], torch.arange(length, device=self.embed.device)[None])
            self._angles = cos[0].contiguous(), _signed_sin(sin[0]).contiguous()
        return self._angles

    def _sdpa(self, q, keys, values, mask, scale):
        """SDPA over the rows' pool columns; q ``[batch, heads, width, head_dim]``; ``mask``
        already repeated for the folded groups (``__call__`` does it once for every layer).
        Returns ``[batch, width, heads * head_dim]``, as ``Attention`` does."""
        batch, heads, width, head_dim = q.shape
        groups = self.folded_groups
        if groups == 1:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            # The query heads that share a key/value head become one head with groups × width query
            # rows (heads are grouped consecutively, as transformers' repeat_kv has them).
            out = F.scaled_dot_product_attention(q.reshape(batch, heads // groups, groups * width, head_dim), keys,
                                                 values, attn_mask=mask, scale=scale)
        return out.view(batch, heads, width, head_dim).transpose(1, 2).reshape(batch, width, -1)

    def _threads(self, rows: int) -> int:
        """The threads of a call of ``rows`` rows: wide from ``wide_from_rows`` on, else the process's."""
        return self.wide_threads if self.wide_threads and rows >= self.wide_from_rows else torch.get_num_threads()

    def _layers_in_one_call(self) -> bool:
        """Whether the layers run as ``decoder_layers``' one C call (which needs the native layer
        operations and attention too)."""
        return self.decoder_layers is not None and self.native_layer_ops and self.native_attention

    def chains_natively(self) -> bool:
        """Whether ``greedy_chain`` runs here: the layers in one C call, and the head and any fusing
        layer on the panel kernel."""
        return (self._layers_in_one_call() and isinstance(self.head, PanelLinear)
                and (self.fuse is None or isinstance(self.fuse, PanelLinear)))

    def reads_host_indices(self) -> bool:
        """Whether a call may come as ``HostIndices`` (``on_host``, ``greedy_chain``): where the
        layers run in one C call, which reads the positions, columns and mask where they lie, and
        the embedding's rows can be copied as they are."""
        return self._layers_in_one_call() and self.embed.is_contiguous()

    def _host_rope_and_attention(self, indices: HostIndices, last_position: int) -> tuple[Rope, Attention]:
        """``indices``' rotary embedding (angles up to ``last_position``) and mask."""
        return (Rope.of_arrays(indices.batch, indices.width, indices.positions, indices.columns,
                               *self._angle_table(last_position)),
                Attention.of_bytes(indices.batch, indices.width, indices.end, indices.seen))

    def _embedded(self, indices: HostIndices) -> torch.Tensor:
        """``F.embedding`` of ``indices``' tokens, ``[batch, width, hidden]``: each row copied from the
        table into a buffer of this forward's, kept while calls come in its shape (a step's), so
        a step makes no tensor for it. The buffer never leaves: the decoder layers consume it (as
        their residual stream) within the call, and a forward runs one call at a time (its
        engine's)."""
        ids, table = indices.ids, self.embed
        if min(ids) < 0 or max(ids) >= table.shape[0]:
            raise IndexError(f"token ids outside the embedding's {table.shape[0]} rows")
        shape = (indices.batch, indices.width, table.shape[1])
        if self._x is None or self._x.shape != shape:
            self._x = torch.empty(shape, dtype=table.dtype)
        size = table.shape[1] * table.element_size()
        x_at, table_at = self._x.data_ptr(), table.data_ptr()
        for i, token in enumerate(ids):
            ctypes.memmove(x_at + i * size, table_at + token * size, size)
        return self._x

    def _layers_and_head(self, x: torch.Tensor, rope: Rope, attention: Attention, kv: torch.Tensor,
                         logits_to_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers in one call, then the head: ``__call__``'s results."""
        batch, width = rope.batch, rope.width
        threads = self._threads(batch * width)
        hidden = self.decoder_layers(x, rope, attention, kv, threads)
        head = self.head
        if not isinstance(head, PanelLinear):
            return head(hidden[:, -logits_to_keep:]).float(), hidden
        if 0 < logits_to_keep <= width and (batch == 1 or logits_to_keep == width):
            # The kept columns lie contiguous in hidden: the head reads them in place.
            first = hidden.data_ptr() + (width - logits_to_keep) * hidden.stride(1) * hidden.element_size()
            return head.multiply_at(first, (batch, logits_to_keep), threads), hidden
        return head(hidden[:, -logits_to_keep:], threads), hidden

    @torch.inference_mode()
    def greedy_chain(self, indices: HostIndices, kv: torch.Tensor, features: torch.Tensor | None, steps: int,
                     to_token: torch.Tensor | None, first_logits: bool = False
                     ) -> tuple[list[list[int]], torch.Tensor | None]:
        """A greedy draft's proposal in one C call (``chains_natively`` says where): this forward's
        tokens as ``on_host`` takes them, then ``steps`` more a row, the row's first at
        ``indices.ends[row]``, each fed the token drafted before it (and, where the model fuses
        features, the final hidden state before it). Every token is the head's argmax (through
        ``to_token``), bitwise what ``__call__`` a forward at a time gives. Returns each row's
        ``steps + 1`` token ids, and with ``first_logits`` the float32 logits of each row's first
        drafted token (else None)."""
        # Angles up to the last drafted token's position; every fed token sits before its row's end.
        rope, attention = self._host_rope_and_attention(indices, max(indices.ends) + steps)
        if features is not None and not features.is_contiguous():
            features = features.contiguous()
        return self.decoder_layers.draft_chain(
            self.embed, self.fuse, indices.ids, features, rope, attention, kv, indices.ends, steps, self.head,
            to_token, self._threads(indices.batch * indices.width), first_logits)

    @torch.inference_mode()
    def on_host(self, indices: HostIndices, kv: torch.Tensor, logits_to_keep: int,
                features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``__call__`` for a call whose tokens and indices come as ``HostIndices``
        (``reads_host_indices`` says where): the same results."""
        # Every fed token's position lies below indices.end.
        rope, attention = self._host_rope_and_attention(indices, indices.end - 1)
        x = self._embedded(indices)
        if self.fuse is not None:
            x = self.fuse(torch.cat([x, features.to(x.dtype)], dim=-1))
        return self._layers_and_head(x, rope, attention, kv, logits_to_keep)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, write_columns: torch.Tensor,
                 kv: torch.Tensor, mask: torch.Tensor, logits_to_keep: int,
                 features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions, write_columns: ``[batch, width]``; kv: ``[layers, 2, batch, kv_heads,
        columns, head_dim]`` (written in place); mask: ``[batch, 1, width, end]``, True where a token
        may attend. Returns float32 logits of the last ``logits_to_keep`` columns and the final
        hidden states ``[batch, width, hidden]``."""
        x = F.embedding(input_ids, self.embed)
        if self.fuse is not None:
            x = self.fuse(torch.cat([x, features.to(x.dtype)], dim=-1))
        end = mask.shape[-1]
        if self.native_layer_ops:
            add_rms_norm, silu_mul = kernel_layers.add_rms_norm, kernel_layers.silu_mul
            rope = Rope(positions, write_columns, *self._angle_table(int(positions.max())))
        else:
            add_rms_norm, silu_mul = _add_rms_norm, _silu_mul
            rope = _TorchRope(*self.rotary(x, positions), write_columns)
        if self.native_attention:
            attention = Attention(mask)
        else:
            attention = functools.partial(self._sdpa, mask=mask.repeat(1, 1, self.folded_groups, 1))
        if self._layers_in_one_call():
            return self._layers_and_head(x.contiguous(), rope, attention, kv, logits_to_keep)
        delta = None  # what the last layer adds to the residual stream x (x is updated in place)
        for i, layer in enumerate(self.layers):
            h = add_rms_norm(x, delta, layer.norm_in, layer.eps)
            keys, values = kv[i, 0], kv[i, 1]  # [batch, kv_heads, columns, head_dim]
            q = rope(layer.qkv(h), layer.q_size // layer.head_dim, layer.kv_size // layer.head_dim, keys, values)
            attn = attention(q, keys[:, :, :end], values[:, :, :end], scale=layer.scaling)
            h = add_rms_norm(x, layer.o(attn), layer.norm_post, layer.eps)
            delta = layer.down(silu_mul(layer.gate_up(h)))
        hidden = add_rms_norm(x, delta, self.norm, self.eps)
        return self.head(hidden[:, -logits_to_keep:]).float(), hidden
