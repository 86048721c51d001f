"""The train phase of `specbatch distill`: the draft reads (token x_i, target feature f_{i-1}) and learns
the target's next-token distribution from f_i, with unrolled passes that feed it its own predicted
features, as drafting token 2, 3, ... will. The trained-only export that ships."""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from specbatch.commands.distill.config import DistillConfig, autocast

# The data phase (answers, corpus, shards, the head's token subset) is distill_data's.
from specbatch.commands.distill.data import (
    _progress,
)
from specbatch.models.eagle import EagleDraftForCausalLM

log = logging.getLogger(__name__)


def _batch(sequences: list[dict], feature_size: int, device: torch.device | str = "cpu"):
    """Pad a batch: inputs (x_i, f_{i-1}) and labels f_i for i = 0 … n-2 of each sequence, on
    ``device``. Assembled in float16 (the shards' precision) and widened there: a quarter of the
    bytes to copy, and the same values as widening first."""
    lengths = [len(s["features"]) for s in sequences]  # features exist for tokens 0 … n-2
    width = max(lengths)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    labels = torch.zeros(len(sequences), width, feature_size, dtype=torch.float16)
    mask = torch.zeros(len(sequences), width, dtype=torch.bool)
    for row, (seq, n) in enumerate(zip(sequences, lengths)):
        ids[row, :n] = seq["tokens"][:n].long()
        labels[row, :n] = seq["features"]
        mask[row, 1:n] = True  # position 0 has no feature to read
    labels = labels.to(device, non_blocking=True).float()
    mask = mask.to(device)
    inputs = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)  # f_{i-1} at i
    inputs = inputs * mask[..., None]  # a padding position reads zeros
    return ids.to(device), inputs, labels, mask


def unrolled_mask(key_valid: torch.Tensor, unroll: int) -> torch.Tensor:
    """Attention of unrolled pass ``p`` (0: true features) over the keys of passes 0 … p.

    Drafting token p+1 at position i, the draft's cache holds positions ≤ i-p read with true
    features and positions i-p+1 … i-1 read with its own predictions (one per earlier pass), so
    pass p's row i sees pass-0 keys j ≤ i-p and pass-q key j = i-p+q (q = 1 … p): training sees
    exactly what drafting sees (the "training-time test" of EAGLE-3, arXiv 2503.01840)."""
    T = key_valid.shape[1]
    i = torch.arange(T, device=key_valid.device)[:, None]
    j = torch.arange(T, device=key_valid.device)[None, :]
    blocks = [j <= i - unroll] + [j == i - unroll + q for q in range(1, unroll + 1)]
    allowed = torch.cat(blocks, dim=1)[None] & key_valid.repeat(1, unroll + 1)[:, None, :]
    return allowed[:, None]  # [batch, 1, T, (unroll+1)·T]


def distill_loss(draft: EagleDraftForCausalLM, ids, inputs, labels, mask, cfg: DistillConfig):
    from transformers.cache_utils import DynamicCache

    head = draft.lm_head
    labels = labels[..., -draft.config.hidden_size :]  # the final hidden state (of fused features: the last slice)
    with torch.no_grad():  # the teacher in full precision, outside any autocast
        teacher = F.softmax(head(labels).float(), dim=-1)
    batch, width = ids.shape
    key_valid = mask.clone()
    key_valid[:, 0] = True
    positions = torch.arange(width, device=ids.device)[None].expand(batch, width)
    cache = DynamicCache(config=draft.config)
    total, stats = 0.0, {}
    features = inputs
    for unroll in range(cfg.unroll):
        scored = mask.clone()
        scored[:, : unroll + 1] = False  # the chain needs a true feature before it
        with autocast(ids.device, cfg.amp):
            hidden = draft.model(input_ids=ids, target_features=features, position_ids=positions, past_key_values=cache,
                                 attention_mask=unrolled_mask(key_valid, unroll), use_cache=True).last_hidden_state
            logits = head(hidden[scored])
        logits, hidden = logits.float(), hidden.float()  # the loss in full precision
        ce = -(teacher[scored] * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        regression = F.smooth_l1_loss(hidden[scored], labels[scored])
        total = total + ce + cfg.regression_weight * regression
        stats[f"agree{unroll + 1}"] = (logits.argmax(-1) == teacher[scored].argmax(-1)).float().mean().item()
        # Next pass: each position reads the draft's prediction at the position before it.
        features = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)
    return total / cfg.unroll, stats


def train(draft: EagleDraftForCausalLM, data: Sequence, out: Path, cfg: DistillConfig) -> None:
    """Trains ``draft`` where it is: every batch is put on the draft's device."""
    folder = out / "checkpoint"
    device = draft.device
    trainable = [p for name, p in draft.named_parameters() if not name.startswith(("lm_head", "model.embed_tokens"))]
    for name, p in draft.named_parameters():
        p.requires_grad_(not name.startswith(("lm_head", "model.embed_tokens")))
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)
    warmup = max(cfg.steps // 20, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / cfg.steps, 1)))))
    step = 0
    if (folder / "state.pt").exists():  # resume
        state = torch.load(folder / "state.pt", map_location=device)
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step = state["step"]
        log.info("resuming training at step %d", step)
    rng = random.Random(cfg.seed + step)
    draft.train()
    progress, task = _progress(cfg.steps, "train: draft")
    progress.update(task, completed=step)
    window: dict[str, float] = {}
    with progress:
        while step < cfg.steps:
            batch = rng.sample(data, min(cfg.batch_sequences, len(data)))
            loss, stats = distill_loss(draft, *_batch(batch, draft.config.feature_size, device), cfg)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            for key, value in {"loss": loss.item(), **stats}.items():
                window[key] = 0.9 * window.get(key, value) + 0.1 * value
            progress.update(task, advance=1, info=" ".join(f"{k} {v:.3f}" for k, v in window.items()))
            if step % 10 == 0:  # the learning curve, for docs and for deciding whether to train on
                with open(out / "train_log.jsonl", "a") as log_file:
                    log_file.write(json.dumps({"step": step, "lr": schedule.get_last_lr()[0], **window}) + "\n")
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                folder.mkdir(parents=True, exist_ok=True)
                torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
                            "schedule": schedule.state_dict(), "step": step}, folder / "state.tmp")
                (folder / "state.tmp").rename(folder / "state.pt")
    draft.eval()
    for p in draft.parameters():
        p.requires_grad_(False)


def export_trained_only(draft: EagleDraftForCausalLM, folder: Path) -> None:
    """Write only what training changed (float16) plus the config: the form the embedded default
    ships in (``specbatch.models.loading.embedded_draft_folder`` adds the target's embeddings and head rows
    back). Embeddings and head are the target's own, so this is a few MB instead of ~120."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shared = ("model.embed_tokens.weight", "lm_head.weight")
    tensors = {name: (t.half() if t.is_floating_point() else t).contiguous()
               for name, t in draft.state_dict().items() if name not in shared}
    save_file(tensors, folder / "trained.safetensors")
    draft.config.to_json_file(folder / "config.json")
