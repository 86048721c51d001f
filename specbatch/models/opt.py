"""The engine's own forward for OPT models, over its KV pool.

The same arithmetic as transformers' ``OPTForCausalLM``, in the way ``specbatch.models.llama`` does it
for Llama: fused QKV projection with weights prepared once (``specbatch.kernels.linear``), new keys/values
written straight into the pool with one indexed copy per tensor, and one SDPA call per layer over
the rows' own pool columns with the engine's 4D mask. No cache objects and no host syncs, so a
step can be captured in a CUDA graph.

OPT's own details, as transformers computes them: learned positional embeddings read at
``position + 2``; ``project_in``/``project_out`` where ``word_embed_proj_dim != hidden_size``;
layer norms before (``do_layer_norm_before``, most OPT models) or after (opt-350m) each block;
queries scaled by ``head_dim ** -0.5`` before the attention (which then scales by 1); the final
layer norm only where the model has one; the output head reads the projected-out hidden states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import OPTForCausalLM

from specbatch.kernels.linear import Linear, fused, linear


def supports(model) -> bool:
    # A target made to return fused features (eagle.fuse_target_features) runs through transformers.
    return isinstance(model, OPTForCausalLM) and not getattr(model.config, "feature_layers", None)


def _linear(layer: torch.nn.Linear | None, weights: str | None) -> Linear | None:
    return None if layer is None else linear(layer.weight, layer.bias, weights)


class _Norm:
    """A LayerNorm's parameters (the weight and bias are None where it has no affine part)."""

    def __init__(self, norm: torch.nn.LayerNorm):
        self.shape, self.eps = norm.normalized_shape, norm.eps
        self.weight = None if norm.weight is None else norm.weight.detach()
        self.bias = None if norm.bias is None else norm.bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)


class _Layer:
    def __init__(self, layer, weights: str | None):
        attn = layer.self_attn
        self.qkv = fused(attn.q_proj, attn.k_proj, attn.v_proj, weights=weights)
        self.out = _linear(attn.out_proj, weights)
        self.fc1, self.fc2 = _linear(layer.fc1, weights), _linear(layer.fc2, weights)
        self.activation = layer.activation_fn.forward  # the module's own function, without hook dispatch
        self.norm_attn, self.norm_mlp = _Norm(layer.self_attn_layer_norm), _Norm(layer.final_layer_norm)
        self.heads, self.head_dim, self.scaling = attn.num_heads, attn.head_dim, attn.scaling


class OptForward:
    """``__call__`` runs one ragged batch: see ``specbatch.engine.batch.RaggedBatch`` for the layout, and
    ``specbatch.models.llama.LlamaForward.__call__`` for the contract (and ``weights``)."""

    def __init__(self, model, weights: str | None = None):
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not an OPT model this forward covers")
        base = model.get_decoder()
        self.embed = base.embed_tokens.weight
        self.positions = base.embed_positions.weight
        self.position_offset = base.embed_positions.offset  # 2: OPT's learned positions start there
        self.project_in, self.project_out = _linear(base.project_in, weights), _linear(base.project_out, weights)
        self.norm_before = model.config.do_layer_norm_before
        self.layers = [_Layer(layer, weights) for layer in base.layers]
        self.final_norm = None if base.final_layer_norm is None else _Norm(base.final_layer_norm)
        self.head = linear(model.get_output_embeddings().weight, None, weights)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, write_columns: torch.Tensor,
                 kv: torch.Tensor, mask: torch.Tensor, logits_to_keep: int,
                 features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaForward.__call__``; the hidden states returned are the decoder's last ones
        (after ``project_out``, what the output head reads), as transformers returns them."""
        if features is not None:
            raise ValueError("an OPT model does not read target features")
        batch, width = input_ids.shape
        x = F.embedding(input_ids, self.embed)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + F.embedding(positions + self.position_offset, self.positions)
        rows = torch.arange(batch, device=input_ids.device)[:, None]
        end = mask.shape[-1]
        before = self.norm_before
        for i, layer in enumerate(self.layers):
            heads, hd = layer.heads, layer.head_dim
            h = layer.norm_attn(x) if before else x
            q, k, v = layer.qkv(h).chunk(3, dim=-1)
            q = (q * layer.scaling).view(batch, width, heads, hd).transpose(1, 2)
            keys, values = kv[i, 0], kv[i, 1]  # [batch, heads, columns, head_dim]
            keys[rows, :, write_columns] = k.view(batch, width, heads, hd)
            values[rows, :, write_columns] = v.view(batch, width, heads, hd)
            attn = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], attn_mask=mask, scale=1.0)
            x = x + layer.out(attn.transpose(1, 2).reshape(batch, width, -1))
            if not before:
                x = layer.norm_attn(x)
            h = layer.norm_mlp(x) if before else x
            x = x + layer.fc2(layer.activation(layer.fc1(h)))
            if not before:
                x = layer.norm_mlp(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return self.head(x[:, -logits_to_keep:]).float(), x
