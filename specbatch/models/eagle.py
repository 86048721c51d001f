"""The EAGLE-style draft: a one-layer decoder that reads the target's own final hidden states.

A draft that sees only tokens must rebuild, in a few layers, what the target's 30 layers know; a
small one agrees with the target's greedy choice rarely (docs/decisions/eagle-draft.md). This draft gets the
target's knowledge for free: at position i it reads the token ``x_i`` *and* the target's final
hidden state ``f_{i-1}`` (the vector the target's output head turned into ``x_i``'s distribution),
and predicts ``f_i``, which the target's own head (restricted to a frequent-token subset, for
speed) turns into a guess for ``x_{i+1}`` (Li et al., "EAGLE", arXiv 2401.15077).

Drafting k tokens: the first forward reads true target features (the target service returns
them with every verification); each further forward reads the draft's own prediction of the
previous feature. Accepted tokens are re-fed next step with the target's true features, so the
draft's cache only ever keeps positions fed with true features.

The model is a plain transformers model (``LlamaModel`` with a fusion layer in front), saved as
safetensors + config and loaded with ``AutoModelForCausalLM`` once this module is imported.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, LlamaModel
from transformers.modeling_outputs import CausalLMOutputWithPast

MODEL_TYPE = "specbatch_eagle"


class EagleDraftConfig(LlamaConfig):
    """A Llama config plus the size of the output-head subset (``vocab_size`` stays the target's)
    and the target layers whose outputs it reads beside the final hidden state (EAGLE-3's fusion;
    none: EAGLE-1)."""

    model_type = MODEL_TYPE

    def __init__(self, draft_vocab_size: int | None = None, feature_layers: list[int] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.draft_vocab_size = draft_vocab_size or self.vocab_size
        self.feature_layers = list(feature_layers or [])
        # The target features it reads per token: those layers' outputs and the final hidden state.
        self.feature_size = self.hidden_size * (1 + len(self.feature_layers))


class EagleDraftModel(LlamaModel):
    config_class = EagleDraftConfig

    def __init__(self, config: EagleDraftConfig):
        super().__init__(config)
        # Fuses the token's embedding with the previous position's target feature.
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        # Fused features (several target layers) are first reduced to one hidden-sized vector;
        # the draft's own predictions, read when drafting token 2, 3, …, are hidden-sized already.
        if config.feature_size != config.hidden_size:
            self.reduce = nn.Linear(config.feature_size, config.hidden_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, target_features=None, **kwargs):
        embeds = self.embed_tokens(input_ids)
        if target_features is None:
            target_features = torch.zeros_like(embeds)
        target_features = target_features.to(embeds.dtype)
        if target_features.shape[-1] != self.config.hidden_size:
            target_features = self.reduce(target_features)
        fused = self.fc(torch.cat([embeds, target_features], dim=-1))
        return super().forward(inputs_embeds=fused, **kwargs)


class EagleDraftForCausalLM(LlamaForCausalLM):
    """Logits are over the head's token subset; ``draft_to_target`` maps a logit column to its
    token id (a buffer saved with the weights)."""

    config_class = EagleDraftConfig
    _tied_weights_keys = {}

    def __init__(self, config: EagleDraftConfig):
        super().__init__(config)
        self.model = EagleDraftModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=True)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, target_features=None, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache=None, logits_to_keep=0, **kwargs):
        out = self.model(input_ids=input_ids, target_features=target_features, attention_mask=attention_mask,
                         position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), past_key_values=out.past_key_values)


AutoConfig.register(MODEL_TYPE, EagleDraftConfig)
AutoModelForCausalLM.register(EagleDraftConfig, EagleDraftForCausalLM)


def reads_target_features(model) -> bool:
    return getattr(model.config, "model_type", None) == MODEL_TYPE


def draft_from_target(target, num_layers: int = 1, token_subset: torch.Tensor | None = None) -> EagleDraftForCausalLM:
    """A fresh draft for ``target`` (a Llama-like causal LM): its embeddings and the subset rows of
    its output head copied (and meant to stay frozen), its last ``num_layers`` layers as the start
    of the draft's, and a fusion layer that starts out passing the feature through. The draft is
    made on the target's device, in its dtype. A target that returns fused features
    (``fuse_target_features``) gets a draft that reads them, starting from the final hidden state
    alone."""
    tc = target.config
    subset = token_subset if token_subset is not None else torch.arange(tc.vocab_size)
    feature_layers = getattr(tc, "feature_layers", None)
    config = EagleDraftConfig(
        draft_vocab_size=len(subset), feature_layers=feature_layers, vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", None), hidden_act=tc.hidden_act,
        max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
        rope_parameters=getattr(tc, "rope_parameters", None), tie_word_embeddings=False,
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id,
        attention_bias=getattr(tc, "attention_bias", False), mlp_bias=getattr(tc, "mlp_bias", False),
    )
    draft = EagleDraftForCausalLM(config)
    draft.config._attn_implementation = target.config._attn_implementation
    base = target.get_decoder()
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head = target.get_output_embeddings().weight
        draft.lm_head.weight.copy_(head[subset.to(head.device)])
        draft.draft_to_target.copy_(subset)
        draft.model.norm.load_state_dict(final_norm(base).state_dict())
        for mine, theirs in zip(draft.model.layers, list(base.layers)[-num_layers:]):
            mine.load_state_dict(theirs.state_dict())
        # [embedding | feature] -> feature: starts as the identity on the feature half.
        hidden = tc.hidden_size
        draft.model.fc.weight.zero_()
        draft.model.fc.weight[:, hidden:] = torch.eye(hidden)
        draft.model.fc.weight[:, :hidden].normal_(0.0, 0.02)
        if feature_layers:  # [layer outputs … | final hidden state] -> the final hidden state, at first
            draft.model.reduce.weight.zero_()
            draft.model.reduce.weight[:, -hidden:] = torch.eye(hidden)
    param = next(target.parameters())
    return draft.to(device=param.device, dtype=param.dtype)  # trained and evaluated beside the target


# ---- EAGLE-3's fused features on the target side ----------------------------------------------------

class FusedFeatures(nn.Module):
    """Stands in for a target decoder's final norm: returns ``[out(l_1), …, out(l_n), norm(h)]``,
    the outputs of the chosen decoder layers beside the final hidden state, so whatever reads the
    decoder's last hidden state (the engine, hence the verifier's features) gets the fusion of
    low, middle and top-layer features of EAGLE-3 (arXiv 2503.01840). The output head reads only
    the last slice (``TopSlice``): the target's logits do not change."""

    def __init__(self, norm: nn.Module, layers: list[nn.Module], indices: list[int]):
        super().__init__()
        self.norm = norm
        self.indices = list(indices)
        self._outputs: dict[int, torch.Tensor] = {}
        for index, layer in zip(self.indices, layers):
            layer.register_forward_hook(self._keep(index))

    def _keep(self, index: int):
        def hook(module, args, output):
            self._outputs[index] = output[0] if isinstance(output, tuple) else output
        return hook

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        taps = [self._outputs.pop(i) for i in self.indices]
        return torch.cat([*taps, self.norm(hidden)], dim=-1)


class TopSlice(nn.Module):
    """The target's output head, reading the final hidden state out of the fused features."""

    def __init__(self, head: nn.Linear, width: int):
        super().__init__()
        self.head, self.width = head, width

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features[..., -self.width :])


def fuse_target_features(target, layers: list[int]):
    """Make ``target`` (a Llama-like causal LM, in place) return fused features: its decoder's last
    hidden state becomes the outputs of decoder ``layers`` (0-based) and the final hidden state,
    concatenated. ``config.feature_layers`` and ``config.target_feature_size`` say so, for the
    target service and for ``draft_from_target``. Returns ``target``."""
    base = target.get_decoder()
    hidden = target.config.hidden_size
    if not layers or isinstance(base.norm, FusedFeatures):
        return target
    if not all(0 <= i < len(base.layers) for i in layers):
        raise ValueError(f"feature layers must be in [0, {len(base.layers) - 1}] (got {layers})")
    base.norm = FusedFeatures(base.norm, [base.layers[i] for i in layers], layers)
    target.lm_head = TopSlice(target.lm_head, hidden)
    target.config.feature_layers = list(layers)
    target.config.target_feature_size = hidden * (1 + len(layers))
    return target


def parse_feature_layers(text: str) -> list[int]:
    """``"2,15"`` -> ``[2, 15]`` (the ``--feature-layers`` flags of distill and the target service)."""
    return [int(part) for part in text.split(",") if part.strip()]


def final_norm(decoder) -> nn.Module:
    norm = decoder.norm
    return norm.norm if isinstance(norm, FusedFeatures) else norm


def target_feature_size(target) -> int:
    """The width of the features ``target`` returns per token (its hidden size unless fused)."""
    return getattr(target.config, "target_feature_size", target.config.hidden_size)
