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
the draft service loads like any model (``--model OUT/draft``)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import torch

from specbatch.commands.distill.config import DistillConfig

# The data phase (answers, corpus, shards, the head's token subset) is distill_data's.
from specbatch.commands.distill.data import (
    FeatureShards,
    collect_corpus,
    collect_data,
    coverage,
    token_subset,
)
from specbatch.commands.distill.evaluate import Evaluation, evaluate, find_eos_token_ids, print_evaluation
from specbatch.commands.distill.train import export_trained_only, train
from specbatch.models.eagle import draft_from_target, fuse_target_features, parse_feature_layers
from specbatch.models.loading import load_draft

log = logging.getLogger(__name__)


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
    if cfg.init_draft:  # a fine-tune: the draft and its head's token subset as they are
        param = next(target.parameters())
        draft = load_draft(cfg.init_draft, target, param.device, param.dtype)
        subset = draft.draft_to_target.cpu()
    else:
        subset = token_subset(data.token_sequences(), cfg.draft_vocab, vocab_size, eos)
        draft = draft_from_target(target, cfg.layers, subset)
    print(f"data: {len(answers)} target answers and {len(data) - len(answers)} corpus conversations, {tokens} tokens; "
          f"head subset of {len(subset)} tokens covers {coverage(answers.token_sequences(), subset, vocab_size):.1%} "
          f"of the target answers' tokens (prompts included)", flush=True)
    train(draft, data, out, cfg)
    final = out / "draft"
    draft.save_pretrained(final)
    tokenizer.save_pretrained(final)
    evaluation = evaluate(target, draft, tokenizer, cfg, eos)
    (out / "evaluation.json").write_text(json.dumps(asdict(evaluation), indent=2))
    print_evaluation(evaluation)
    print(f"draft saved to {final}: serve it with  python -m draft_service --model {final}", flush=True)
    return evaluation


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
    from specbatch.models.embedded import EMBEDDED
    from specbatch.models.loading import ModelSpec, load_model, load_tokenizer

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
