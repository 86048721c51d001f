"""What `specbatch distill` is told: the draft's shape, the data, training and evaluation settings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The data phase (answers, corpus, shards, the head's token subset) is distill_data's.


@dataclass
class DistillConfig:
    """Defaults: the recipe of the embedded default draft (docs/draft.md)."""

    prompts: int = 256  # training prompts the target answers
    max_new_tokens: int = 160
    max_prompt_tokens: int = 256
    corpus_tokens: int = 60000  # also this many tokens of ShareGPT conversations, read by the target
    corpus_max_tokens: int = 384  # per conversation
    data_batch: int = 32  # prompts answered at once
    draft_vocab: int = 8192  # output-head subset size
    layers: int = 1
    steps: int = 800
    batch_sequences: int = 4
    lr: float = 1e-3
    # Feature regression beside the cross-entropy (EAGLE-1 uses both). Measured here it held
    # agreement back: switching it off at step 500 took agreement from 0.33 to 0.35 in 50 steps.
    regression_weight: float = 0.0
    unroll: int = 2  # passes per step: 1 = true features only; p > 1 trains drafting token p as well
    checkpoint_every: int = 50
    eval_prompts: int = 12
    eval_k: int = 5
    eval_new_tokens: int = 96
    seed: int = 0
    # Mixed precision of the draft's training forward: "auto" is bf16 on CUDA and none on a CPU.
    # bf16 autocast keeps float32 master weights and optimizer state; the teacher distribution and
    # the loss stay float32. On CUDA it is the usual, safe choice (EAGLE's own recipe trains in
    # bf16). On a CPU it is faster where bf16 is native, but whether it costs agreement is
    # unmeasured there, so a CPU keeps float32 unless asked (docs/draft.md).
    amp: str = "auto"  # auto | bf16 | none
    # EAGLE-3's fusion: the target also returns these decoder layers' outputs (0-based, comma
    # separated, e.g. "2,15" for SmolLM2's 30 layers) beside its final hidden state; "" = EAGLE-1.
    # The target service must then run with the same --feature-layers.
    feature_layers: str = ""
    # The target's weight form in the data and evaluate phases (specbatch.kernels.forms; "model": as
    # loaded). A quantized target keeps other tokens and features than the float one, so a draft
    # meant for it learns from it: "q4_1" is the embedded target as a CPU serves it.
    weights: str = "model"
    # Start from this draft (a model folder, a trained-only folder, or the embedded draft's name)
    # instead of the target's last layers; its head's token subset stays. A fine-tune: fewer steps,
    # a smaller --lr.
    init_draft: str = ""


def engine_options(cfg: DistillConfig, target) -> dict:
    """What the data and evaluate phases build the target's engine with: ``cfg.weights``."""
    from specbatch.kernels import forms

    return forms.engine_options(cfg.weights, next(target.parameters()).device.type)


def amp_dtype(device: torch.device | str, amp: str) -> torch.dtype | None:
    if amp not in ("auto", "bf16", "none"):
        raise ValueError(f"--amp must be auto, bf16 or none (got {amp!r})")
    if amp == "bf16" or (amp == "auto" and torch.device(device).type == "cuda"):
        return torch.bfloat16
    return None


def autocast(device: torch.device | str, amp: str):
    dtype = amp_dtype(device, amp)
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None)
