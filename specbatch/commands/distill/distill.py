"""``specbatch distill``: train an EAGLE-style draft (``specbatch.models.eagle``) for a target model.

Four resumable phases, each leaving its result in the output folder, all on one device (the
target's; ``--device``):

1. **data**: the target answers real prompts (ShareGPT first turns) greedily, through the same
   engine and verifier the target service runs, and reads ShareGPT conversations; every token's
   feature (final hidden state, or EAGLE-3's fused layers with ``--feature-layers``) is kept, in
   safetensors shards that training reads lazily (``FeatureShards``).
2. **vocab**: the draft's output head covers the most frequent tokens of that data, so that
   a drafted token costs a fraction of the target's full-vocabulary head.
3. **train**: the draft reads (token ``x_i``, target feature ``f_{i-1}``) and learns to predict
   ``f_i``: the loss is the cross-entropy against the target's next-token distribution
   (``softmax(head(f_i))`` on the subset). Unrolled passes feed the draft its own predicted
   features, as it will be fed when drafting token 2, 3, … (bf16 autocast on CUDA: ``--amp``).
4. **evaluate**: greedy speculative decoding on held-out prompts with the service code, run
   in-process: acceptance per drafted position, and the draft's cost per token beside the
   target's one-token forward.

The result, ``OUT/draft``, is a safetensors checkpoint with its config and the tokenizer, which
the draft service loads like any model (``--model OUT/draft``).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specbatch.models.eagle import EagleDraftForCausalLM, draft_from_target, fuse_target_features, parse_feature_layers
from specbatch.engine.engine import Engine, SequenceInput
from specbatch.commands.prompts import sharegpt_prompts
# The data phase (answers, corpus, shards, the head's token subset) is distill_data's.
from specbatch.commands.distill.data import (EVAL_PROMPTS_FROM, FeatureShards, _progress, chat_prompt_ids, collect_corpus,
                           collect_data, coverage, token_subset)

log = logging.getLogger(__name__)



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
    # bf16). On a CPU with AVX512-BF16 it made a SmolLM2 draft's step 1.7x faster (docs/draft.md),
    # but whether it costs agreement is unmeasured there, so a CPU keeps float32 unless asked.
    amp: str = "auto"  # auto | bf16 | none
    # EAGLE-3's fusion: the target also returns these decoder layers' outputs (0-based, comma
    # separated, e.g. "2,15" for SmolLM2's 30 layers) beside its final hidden state; "" = EAGLE-1.
    # The target service must then run with the same --feature-layers.
    feature_layers: str = ""


def amp_dtype(device: torch.device | str, amp: str) -> torch.dtype | None:
    if amp not in ("auto", "bf16", "none"):
        raise ValueError(f"--amp must be auto, bf16 or none (got {amp!r})")
    if amp == "bf16" or (amp == "auto" and torch.device(device).type == "cuda"):
        return torch.bfloat16
    return None


def autocast(device: torch.device | str, amp: str):
    dtype = amp_dtype(device, amp)
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None)


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


# ---- 4. evaluation ---------------------------------------------------------------------------------

@dataclass
class Evaluation:
    prompts: int
    k: int
    steps: int
    tokens: int
    acceptance: float  # accepted / proposed over all drafted positions
    acceptance_by_position: list[float]  # P(position j accepted | positions < j accepted)
    tokens_per_step: float
    draft_ms_per_token: float  # one drafted token at batch 1
    target_ms_per_forward: float  # one target forward of one new token at batch 1
    cost_ratio: float


def evaluate(target, draft, tokenizer, cfg: DistillConfig, eos: set[int]) -> Evaluation:
    """Greedy speculative decoding at batch 1 on held-out prompts (ShareGPT from conversation
    ``EVAL_PROMPTS_FROM``), with the services' code."""
    texts = sharegpt_prompts(cfg.eval_prompts, start=EVAL_PROMPTS_FROM)
    prompts = [chat_prompt_ids(tokenizer, text, cfg.max_prompt_tokens) for text in texts]
    return speculate(target, draft, prompts, cfg.eval_k, cfg.eval_new_tokens, eos, "evaluate: held-out prompts")


@dataclass
class SpeculativeStep:
    """One step of ``greedy_speculative_steps``."""

    drafts: list[int]  # what the draft proposed
    verdict: object  # target_service.verifier.Verdict: accepted count, next token, features
    propose_seconds: float  # the draft's call, wall time
    read_prompt: bool  # that call also read the prompt: a prefill, timed by neither side


@torch.inference_mode()
def greedy_speculative_steps(target_engine: Engine, draft_engine: Engine, prompts: list[list[int]], k: int,
                             new_tokens: int, eos: set[int], prompt_done=None):
    """Greedy speculative decoding at batch 1, one prompt after another, through the target
    service's verifier and the draft service's proposer on the given engines: yields every step.
    ``prompt_done()``, if given, is called after each prompt."""
    from draft_service.proposer import ProposeItem, propose
    from target_service.verifier import VerifyItem, verify

    for n, prompt in enumerate(prompts):
        seq = f"eval-{n}"
        (verdict,) = verify(target_engine, [VerifyItem(SequenceInput(seq, 0, prompt))], create=True, return_features=True)
        history, features = prompt + [verdict.next_token], [verdict.features]
        target_len, draft_len = verdict.cached_len, 0
        while len(history) - len(prompt) < new_tokens and history[-1] not in eos:
            feats = torch.cat(features)
            fed = torch.cat([torch.zeros(1, feats.shape[1]), feats])[draft_len : len(history)]
            started = time.perf_counter()
            (drafts,) = propose(draft_engine, [ProposeItem(SequenceInput(seq, draft_len, history[draft_len:], fed), k)])
            seconds = time.perf_counter() - started
            (verdict,) = verify(target_engine, [VerifyItem(SequenceInput(seq, target_len, history[target_len:]), drafts)],
                                return_features=True)
            yield SpeculativeStep(drafts, verdict, seconds, read_prompt=draft_len == 0)
            draft_len = len(history)  # the draft keeps only what it read with true features
            history += drafts[: verdict.accepted] + [verdict.next_token]
            features.append(verdict.features)
            target_len = verdict.cached_len
        target_engine.release([seq])
        draft_engine.release([seq])
        if prompt_done:
            prompt_done()


@torch.inference_mode()
def speculate(target, draft, prompts: list[list[int]], k: int, new_tokens: int, eos: set[int],
              description: str = "speculate") -> Evaluation:
    """Greedy speculative decoding at batch 1 (``greedy_speculative_steps``), each model on the
    device it is on: acceptance per drafted position, tokens per target forward, and the draft's
    time per drafted token (steady state: the call that reads the prompt is not timed) beside one
    one-token target forward."""
    target_engine, draft_engine = Engine(target, max_sequences=2), Engine(draft, max_sequences=2)
    reached = [0] * (k + 1)  # reached[j]: steps where positions 1..j were all accepted
    steps = tokens = 0
    draft_seconds = draft_tokens = 0.0
    progress, task = _progress(len(prompts), description)
    with progress:
        for step in greedy_speculative_steps(target_engine, draft_engine, prompts, k, new_tokens, eos,
                                             lambda: progress.advance(task)):
            if not step.read_prompt:
                draft_seconds += step.propose_seconds
                draft_tokens += k
            for j in range(step.verdict.accepted + 1):
                reached[j] += 1
            steps += 1
            tokens += step.verdict.accepted + 1
    by_position = [reached[j] / reached[j - 1] if reached[j - 1] else 0.0 for j in range(1, k + 1)]
    accepted = sum(reached[1:])
    target_ms = _target_forward_ms(target_engine)
    draft_ms = 1000 * draft_seconds / max(draft_tokens, 1)
    return Evaluation(len(prompts), k, steps, tokens, accepted / max(steps * k, 1), by_position,
                      tokens / max(steps, 1), draft_ms, target_ms, draft_ms / target_ms)


def _target_forward_ms(engine: Engine, context: int = 128, repeats: int = 20) -> float:
    """Median time of a one-new-token target forward at batch 1 (with ``context`` cached)."""
    from target_service.verifier import VerifyItem, verify

    context = min(context, engine.max_context - 2)
    tokens = [(10 + i) % engine.vocab_size for i in range(context)]
    verify(engine, [VerifyItem(SequenceInput("timing", 0, tokens))], create=True)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        verify(engine, [VerifyItem(SequenceInput("timing", context, [11]))])
        times.append(time.perf_counter() - started)
    engine.release(["timing"])
    return 1000 * sorted(times)[len(times) // 2]


# ---- the command -----------------------------------------------------------------------------------

def find_eos_token_ids(tokenizer, target) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(target.generation_config, "eos_token_id", None) if getattr(target, "generation_config", None) else None
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def distill(target, tokenizer, out: Path, cfg: DistillConfig) -> Evaluation:
    out.mkdir(parents=True, exist_ok=True)
    settings = out / "distill.json"
    if settings.exists() and json.loads(settings.read_text()) != asdict(cfg):
        log.warning("settings differ from those %s was started with; resuming with the new ones", out)
    settings.write_text(json.dumps(asdict(cfg), indent=2))
    torch.manual_seed(cfg.seed)
    fuse_target_features(target, parse_feature_layers(cfg.feature_layers))
    eos = find_eos_token_ids(tokenizer, target)
    answer_shards = collect_data(target, tokenizer, out, cfg, eos)
    answers = FeatureShards(answer_shards)
    data = FeatureShards(answer_shards + collect_corpus(target, tokenizer, out, cfg))
    tokens = sum(len(t) for t in data.token_sequences())
    vocab_size = target.get_input_embeddings().weight.shape[0]
    subset = token_subset(data.token_sequences(), cfg.draft_vocab, vocab_size, eos)
    print(f"data: {len(answers)} target answers and {len(data) - len(answers)} corpus conversations, {tokens} tokens; "
          f"head subset of {len(subset)} tokens covers {coverage(answers.token_sequences(), subset, vocab_size):.1%} "
          f"of the target answers' tokens (prompts included)", flush=True)
    draft = draft_from_target(target, cfg.layers, subset)
    train(draft, data, out, cfg)
    final = out / "draft"
    draft.save_pretrained(final)
    tokenizer.save_pretrained(final)
    evaluation = evaluate(target, draft, tokenizer, cfg, eos)
    (out / "evaluation.json").write_text(json.dumps(asdict(evaluation), indent=2))
    print_evaluation(evaluation)
    print(f"draft saved to {final}: serve it with  python -m draft_service --model {final}", flush=True)
    return evaluation


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


def print_evaluation(e: Evaluation) -> None:
    positions = " ".join(f"{a:.2f}" for a in e.acceptance_by_position)
    print(f"evaluation on {e.prompts} held-out prompts, k={e.k}, batch 1, greedy:\n"
          f"  acceptance {e.acceptance:.3f} per drafted token; by position {positions}\n"
          f"  {e.tokens_per_step:.2f} tokens per target forward ({e.tokens} tokens in {e.steps} steps)\n"
          f"  draft {e.draft_ms_per_token:.2f} ms per token vs target forward {e.target_ms_per_forward:.2f} ms "
          f"(cost ratio {e.cost_ratio:.3f})", flush=True)


def add_distill_flags(parser) -> None:
    defaults = DistillConfig()
    parser.add_argument("--target", default=None, help="target model: hub id, folder, or the embedded default")
    parser.add_argument("--gguf-file")
    parser.add_argument("--out", required=True, help="output folder (re-run the same command to resume)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--export-trained-only", metavar="DIR",
                        help="also write only the trained weights (the embedded default draft's shipped form)")
    for name, value in asdict(defaults).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)


def run_distill(args) -> int:
    from specbatch.models.loading import EMBEDDED, ModelSpec, load_model, load_tokenizer

    cfg = DistillConfig(**{name: getattr(args, name) for name in asdict(DistillConfig())})
    spec = ModelSpec(args.target or EMBEDDED, args.gguf_file)
    target = load_model(spec, args.device, "float32")
    for p in target.parameters():
        p.requires_grad_(False)
    distill(target, load_tokenizer(spec), Path(args.out), cfg)
    if args.export_trained_only:
        from transformers import AutoModelForCausalLM

        export_trained_only(AutoModelForCausalLM.from_pretrained(Path(args.out) / "draft"), Path(args.export_trained_only))
    return 0
