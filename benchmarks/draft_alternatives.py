"""How many more tokens a step would keep if the draft also offered its next-best tokens (a measurement
for a tree of drafts; nothing in the services uses it yet).

Greedy speculative decoding at batch 1 through the serving code
(``specbatch.commands.distill.evaluate.speculative_steps``: the coordinator's decode step over the
draft and target services' servicers, on engines in this process), embedded target and shipped
draft, held-out ShareGPT prompts. At each step the draft's top-W tokens at every drafted position
are recorded; where the target rejects the draft at position j, a tree that had also offered the
draft's 2nd … W-th choice at j as leaves would have kept the target's token there if it is among
them, plus the token after it (the target's logits at the leaf): one more token that step.
Prints tokens per step of the chain and, for W = 2 … 4, with leaves at every drafted position or
at the first only. A leaf costs the target one more token row in the verify call and the draft
nothing (the top-W come from logits it computes anyway).

    .venv/bin/python benchmarks/draft_alternatives.py [--k 3] [--prompts 24] [--tokens 96]
"""

from __future__ import annotations

import argparse
import collections

import torch

from specbatch.commands import results
from specbatch.commands.distill.data import EVAL_PROMPTS_FROM, chat_prompt_ids
from specbatch.commands.distill.evaluate import find_eos_token_ids, speculative_steps
from specbatch.commands.prompts import sharegpt_prompts
from specbatch.engine.engine import Engine
from specbatch.models.eagle import fuse_target_features
from specbatch.models.embedded import EMBEDDED, EMBEDDED_DRAFT
from specbatch.models.loading import ModelSpec, load_model, load_tokenizer, parse_dtype

MAX_W = 4


def recording_draft_logits(engine: Engine, logits: list[torch.Tensor]) -> None:
    """Make every batch the draft engine starts append the logits its forwards return to ``logits``."""
    start = engine.start

    def recorded(*args, **kwargs):
        batch = start(*args, **kwargs)
        prefill, decode = batch.prefill, batch.decode

        def recorded_prefill(logits_to_keep=1):
            out = prefill(logits_to_keep)
            logits.append(out[:, -1].float())
            return out

        def recorded_decode(tokens, features=None):
            out = decode(tokens, features)
            logits.append(out.float())
            return out

        batch.prefill, batch.decode = recorded_prefill, recorded_decode
        return batch

    engine.start = recorded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    results.add_output_flags(parser, "draft_alternatives")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    k = args.k

    dtype = parse_dtype("auto", "cpu")
    spec = ModelSpec(EMBEDDED)
    target, tokenizer = load_model(spec, "cpu", dtype), load_tokenizer(spec)
    draft = load_model(ModelSpec(EMBEDDED_DRAFT), "cpu", dtype)
    layers = list(getattr(draft.config, "feature_layers", None) or [])
    if layers:
        target = fuse_target_features(target, layers)
    eos = find_eos_token_ids(tokenizer, target)
    prompts = [chat_prompt_ids(tokenizer, text, 256) for text in sharegpt_prompts(args.prompts, start=EVAL_PROMPTS_FROM)]
    target_engine, draft_engine = Engine(target, max_sequences=2), Engine(draft, max_sequences=2)
    draft_logits: list[torch.Tensor] = []
    recording_draft_logits(draft_engine, draft_logits)
    to_token = draft_engine.output_token_ids  # the draft's head covers a token subset

    steps = tokens = rejections = 0
    hits = collections.Counter()  # (position rejected, W) -> steps where a leaf would have kept the target's token
    for step in speculative_steps(target_engine, draft_engine, prompts, k, args.tokens, eos):
        # The step's Propose ran the last forwards, one per drafted position (a draft prefill of
        # the prompt may come before them).
        top = [logits.topk(MAX_W, -1).indices[0] for logits in draft_logits[len(draft_logits) - step.drafted :]]
        top = [(column if to_token is None else to_token[column]).tolist() for column in top]
        draft_logits.clear()
        accepted = step.accepted
        if accepted < step.drafted and step.next_token is not None:
            rejections += 1
            for w in range(2, MAX_W + 1):
                hits[accepted, w] += step.next_token in top[accepted][1:w]
        steps += 1
        tokens += accepted + 1

    print(f"\ngreedy, batch 1, k={k}, {args.prompts} held-out prompts x {args.tokens} tokens, {str(dtype).removeprefix('torch.')}: "
          f"{steps} steps, {tokens / steps:.3f} tokens per step (chain)\n")
    rows = []
    for w in range(2, MAX_W + 1):
        every = sum(hits[p, w] for p in range(k))
        rows.append({"leaves": f"top-{w} at every drafted position", "verify_rows_added": k * (w - 1),
                     "tokens_per_step": round((tokens + every) / steps, 3), "gain": round(every / steps, 3),
                     "rejections_caught": round(every / max(rejections, 1), 3)})
        rows.append({"leaves": f"top-{w} at the first position", "verify_rows_added": w - 1,
                     "tokens_per_step": round((tokens + hits[0, w]) / steps, 3), "gain": round(hits[0, w] / steps, 3),
                     "rejections_caught": round(hits[0, w] / max(rejections, 1), 3)})
    print("| leaves | verify rows added | tokens per step | gain | rejections a leaf would catch |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['leaves']} | {row['verify_rows_added']} | {row['tokens_per_step']:.3f} | +{row['gain']:.3f} | "
              f"{row['rejections_caught']:.1%} |")
    results.write("draft_alternatives", {"k": k, "prompts": args.prompts, "tokens": args.tokens, "steps": steps,
                                         "tokens_per_step": round(tokens / steps, 3), "rows": rows},
                  args.out, args.variant, "cpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
