"""Untrained EAGLE-style drafts of the candidate shapes, to time them with draft_eval.py.

A drafted token's cost depends on the draft's shape, not on its weights, so the cost of a
candidate (a second layer, a larger head subset, fused features) can be measured before a GPU
trains it. Each folder loads like a distilled ``OUT/draft``:

    .venv/bin/python benchmarks/draft_shapes.py --out runs/shapes
    .venv/bin/python benchmarks/draft_eval.py --sources sharegpt --prompts 4 --new-tokens 32 \\
        --draft l1-v8k=runs/shapes/l1-v8k --draft l2-v8k=runs/shapes/l2-v8k \\
        --draft l1-v16k=runs/shapes/l1-v16k --draft l1-v8k-fused=runs/shapes/l1-v8k-fused

(acceptance is meaningless there: only the cost columns count).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from specbatch.models.eagle import draft_from_target, fuse_target_features
from specbatch.models.loading import ModelSpec, load_model, load_tokenizer

# name: (decoder layers, head subset size, fused target layers)
SHAPES = {"l1-v8k": (1, 8192, []), "l2-v8k": (2, 8192, []), "l1-v16k": (1, 16384, []), "l1-v8k-fused": (1, 8192, [2, 15])}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", default=ModelSpec().name)
    args = parser.parse_args(argv)
    spec = ModelSpec(args.target)
    target, tokenizer = load_model(spec, "cpu", "float32"), load_tokenizer(spec)
    for name, (layers, vocab, fused) in SHAPES.items():
        source = fuse_target_features(copy.deepcopy(target), fused) if fused else target
        draft = draft_from_target(source, layers, torch.arange(vocab))  # the subset's tokens do not change the cost
        draft.save_pretrained(args.out / name)
        tokenizer.save_pretrained(args.out / name)
        trained = sum(p.numel() for n, p in draft.named_parameters() if not n.startswith(("lm_head", "model.embed_tokens")))
        print(f"{name}: {trained / 1e6:.1f} M trained parameters -> {args.out / name}")


if __name__ == "__main__":
    main()
