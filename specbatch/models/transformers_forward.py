"""The engine's forward for models its own forwards (``specbatch.engine.engine.OWN_FORWARDS``) do not
cover: the model's own transformers forward, run over a call's view of the engine's KV pool
through a cache object that writes each row's new keys/values into its own next columns. Same
contract as ``specbatch.models.llama.LlamaForward.__call__``."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class _BatchLayer(DynamicLayer):
    """One layer of a call's batch cache for transformers' forward: new keys/values are written
    into each row's own next columns, and attention sees the first ``end`` columns of every row."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, write_columns: torch.Tensor, end: int):
        super().__init__()
        self.keys_buffer, self.values_buffer, self.end = keys, values, end
        self.rows = torch.arange(keys.shape[0], device=keys.device)[:, None]
        self.write_columns = write_columns
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        # One indexed copy per tensor ([batch, width] positions); a scatter_ with an expanded
        # index cost far more a layer on the CPU.
        self.keys_buffer[self.rows, :, self.write_columns] = key_states.transpose(1, 2)
        self.values_buffer[self.rows, :, self.write_columns] = value_states.transpose(1, 2)
        return self.keys_buffer[:, :, : self.end], self.values_buffer[:, :, : self.end]

    def get_seq_length(self) -> int:
        return self.end

    def get_mask_sizes(self, query_length, *args, **kwargs):
        return self.end, 0


class TransformersForward:
    """The model's own transformers forward over a call's pool view: the path for every model
    that the engine's own forwards do not cover. Same contract as ``LlamaForward.__call__``."""

    def __init__(self, model):
        self.model = model
        self.mask_kind = model.config._attn_implementation
        if self.mask_kind not in ("sdpa", "eager"):
            raise ValueError(f"attention implementation {self.mask_kind!r} is not supported: load with sdpa or eager")
        self.dtype = next(model.parameters()).dtype

    def attention_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """The 4D mask in the form the model's attention takes: boolean for SDPA, additive for eager."""
        if self.mask_kind == "sdpa":
            return allowed
        return torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(self.dtype).min
        )

    @torch.inference_mode()
    def __call__(self, input_ids, positions, write_columns, kv, mask, logits_to_keep, features=None):
        end = mask.shape[-1]
        cache = Cache(layers=[_BatchLayer(kv[i, 0], kv[i, 1], write_columns, end) for i in range(kv.shape[0])])
        hidden = []
        extra = {} if features is None else {"target_features": features}
        # Hooked for this call only: a hook left on the model would outlive the engine (and
        # stop the model from being copied).
        hook = self.model.get_decoder().register_forward_hook(
            lambda module, args, output: hidden.append(
                output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]))
        try:
            out = self.model(input_ids=input_ids, attention_mask=self.attention_mask(mask), position_ids=positions,
                             past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep, **extra)
        finally:
            hook.remove()
        return out.logits.float(), hidden[0]
