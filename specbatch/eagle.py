"""The EAGLE-style draft: a one-layer decoder that reads the target's own final hidden states.

A draft that sees only tokens must rebuild, in a few layers, what the target's 30 layers know; a
small one agrees with the target's greedy choice rarely (docs/draft.md). This draft gets the
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
    """A Llama config plus the size of the output-head subset; ``vocab_size`` stays the target's."""

    model_type = MODEL_TYPE

    def __init__(self, draft_vocab_size: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.draft_vocab_size = draft_vocab_size or self.vocab_size
        self.feature_size = self.hidden_size  # the target features it reads: the target's hidden size


class EagleDraftModel(LlamaModel):
    config_class = EagleDraftConfig

    def __init__(self, config: EagleDraftConfig):
        super().__init__(config)
        # Fuses the token's embedding with the previous position's target feature.
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, target_features=None, **kwargs):
        embeds = self.embed_tokens(input_ids)
        if target_features is None:
            target_features = torch.zeros_like(embeds)
        fused = self.fc(torch.cat([embeds, target_features.to(embeds.dtype)], dim=-1))
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
    made on the target's device, in its dtype."""
    tc = target.config
    subset = token_subset if token_subset is not None else torch.arange(tc.vocab_size)
    config = EagleDraftConfig(
        draft_vocab_size=len(subset), vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
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
        draft.model.norm.load_state_dict(base.norm.state_dict())
        for mine, theirs in zip(draft.model.layers, list(base.layers)[-num_layers:]):
            mine.load_state_dict(theirs.state_dict())
        # [embedding | feature] -> feature: starts as the identity on the feature half.
        hidden = tc.hidden_size
        draft.model.fc.weight.zero_()
        draft.model.fc.weight[:, hidden:] = torch.eye(hidden)
        draft.model.fc.weight[:, :hidden].normal_(0.0, 0.02)
    param = next(target.parameters())
    return draft.to(device=param.device, dtype=param.dtype)  # trained and evaluated beside the target
