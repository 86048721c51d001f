"""Models of any shape with random weights, built on the device without a download (as vLLM's
``--load-format dummy``): step times depend on a model's shape, not on its weights, so the
engine and the profile can be measured for a model whose weights are not here.

A shape is named by an HF config: a folder with ``config.json``, or one of ``KNOWN_CONFIGS``
(written out here because the machines that measure may have no hub access). Weights are drawn
from N(0, initializer_range) (0.02 for every known shape), norm gains are 1 and biases 0: small
and finite, so activations stay finite in bfloat16 and float16. The draw is seeded, so the same
shape gives the same weights on every start.

Prompts need a tokenizer: the folder's own when it has one, else the embedded SmolLM2 tokenizer
(vocabulary 49152, which every known shape covers). Callers that feed token ids to a model with a
smaller vocabulary take them modulo its vocabulary (see ``fit_vocab``).
"""

from __future__ import annotations

from pathlib import Path

import torch

_OPT = {"model_type": "opt", "vocab_size": 50272, "max_position_embeddings": 2048, "do_layer_norm_before": True,
        "activation_function": "relu", "enable_bias": True, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2,
        "initializer_range": 0.02, "tie_word_embeddings": True}
# What the Llama 3 family's configs share (the target and both drafts of it below).
_LLAMA3 = {"vocab_size": 128256, "num_attention_heads": 32, "num_key_value_heads": 8,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "hidden_act": "silu",
           "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
           "bos_token_id": 128000, "eos_token_id": 128001, "initializer_range": 0.02}

# The published configs of these models, as far as the forward's shape and cost go.
KNOWN_CONFIGS: dict[str, dict] = {
    "opt-6.7b": {**_OPT, "hidden_size": 4096, "word_embed_proj_dim": 4096, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "ffn_dim": 16384},
    "opt-125m": {**_OPT, "hidden_size": 768, "word_embed_proj_dim": 768, "num_hidden_layers": 12,
                 "num_attention_heads": 12, "ffn_dim": 3072},
    "llama-3-8b": {**_LLAMA3, "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "head_dim": 128, "tie_word_embeddings": False},
    # Llama-3-8B's small drafts: Llama-3.2-1B (same tokenizer), and an EAGLE-style one-layer head
    # over its features (specbatch.models.eagle; a 32k-token head subset, as EAGLE-3's).
    "llama-3.2-1b": {**_LLAMA3, "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "head_dim": 64, "tie_word_embeddings": True},
    "llama-3-8b-eagle": {**_LLAMA3, "model_type": "specbatch_eagle", "draft_vocab_size": 32768,
                         "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 1, "head_dim": 128,
                         "tie_word_embeddings": False},
    # The embedded target's own config (specbatch.models.embedded.EMBEDDED).
    "smollm2-135m": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                     "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "hidden_act": "silu",
                     "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
                     "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
                     "initializer_range": 0.02},
}
ALIASES = {"facebook/opt-6.7b": "opt-6.7b", "facebook/opt-125m": "opt-125m", "meta-llama/meta-llama-3-8b": "llama-3-8b",
           "llama3-8b": "llama-3-8b", "meta-llama/llama-3.2-1b": "llama-3.2-1b",
           "huggingfacetb/smollm2-135m": "smollm2-135m",
           "huggingfacetb/smollm2-135m-instruct": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m"}


def known_name(name: str) -> str | None:
    key = name.lower()
    key = ALIASES.get(key, key)
    return key if key in KNOWN_CONFIGS else None


def random_config(name: str):
    """The HF config of a known shape or of a folder's ``config.json``."""
    from transformers import AutoConfig

    from specbatch.models import eagle  # noqa: F401 - a draft folder may hold an EAGLE-style config
    from specbatch.models.embedded import EMBEDDED_DRAFT, SHIPPED_DRAFT

    if name == EMBEDDED_DRAFT:  # the services' default draft: its shipped config says what it is
        name = str(SHIPPED_DRAFT)
    known = known_name(name)
    if known:
        values = dict(KNOWN_CONFIGS[known])
        return AutoConfig.for_model(values.pop("model_type"), **values)
    if (Path(name) / "config.json").is_file():
        return AutoConfig.from_pretrained(name)
    raise ValueError(f"random weights need a shape: a folder with config.json or one of {', '.join(KNOWN_CONFIGS)} "
                     f"(got {name!r})")


@torch.no_grad()
def random_model(name: str, device: str | torch.device, dtype: torch.dtype, seed: int = 0):
    """A causal LM of ``name``'s shape with random weights, allocated on ``device`` in ``dtype``.

    Parameters are allocated uninitialised (transformers' ``no_init_weights`` skips its init,
    which on a 7B shape costs minutes on a CPU) and filled once with a cheap normal draw; buffers
    such as rotary frequencies are computed by the model's own constructor as usual.
    """
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = random_config(name)
    # An EAGLE-style draft's head covers a token subset through its trained index table
    # (draft_to_target); its random form keeps the constructor's table, the first
    # draft_vocab_size ids: the same shapes and work, and random weights accept nothing anyway.
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        model.tie_weights()  # skipped with the init under no_init_weights; a tied head is one matrix
    std = getattr(config, "initializer_range", 0.02)
    generator = torch.Generator(device=device).manual_seed(seed)
    for pname, param in model.named_parameters():  # tied weights are listed once
        if param.dim() == 1:  # norm gains and biases
            param.fill_(1.0 if pname.endswith("weight") else 0.0)
        else:
            param.normal_(0.0, std, generator=generator)
    model.generation_config.eos_token_id = None  # random weights: no meaningful end of text
    return model.eval()


def tokenizer_source(name: str) -> str:
    """Where the tokenizer for a random-weights model comes from: the config folder's own
    tokenizer if it has one, else the embedded SmolLM2 tokenizer."""
    from specbatch.models.embedded import EMBEDDED

    folder = Path(name)
    if not known_name(name) and any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return name
    return EMBEDDED


def fit_vocab(token_ids: list[int], vocab_size: int) -> list[int]:
    """Token ids of another tokenizer made valid for a model: modulo its vocabulary."""
    return [t % vocab_size for t in token_ids]
