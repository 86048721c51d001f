"""Several drafts side by side, in one run, on the same prompts of two sources.

For each draft and each prompt set: greedy speculative decoding at batch 1 and a fixed k through
the serving code (``specbatch.commands.distill.evaluate.speculate``: the coordinator's decode step
over the target and draft services' servicers, on engines in this process), reporting acceptance
per drafted position (each given the ones before it), tokens per target forward, and the draft's
cost per drafted token over one one-token target forward, both timed through the Engine in the
dtype the services use. The target runs in the weight form its service runs (``--weights``): a
quantized target keeps other tokens, so a draft is judged against the target as served.

Prompt sets: ShareGPT first turns from conversation 16000 (held out: ``specbatch distill`` never
reads past it) and MT-Bench first turns (``specbatch.commands.prompts.mt_bench_prompts``: another public set
of chat questions, never trained on, kept with their license in specbatch/commands/data/mt_bench/).

    .venv/bin/python benchmarks/draft_eval.py \\
        --draft shipped=smollm2-135m-instruct-draft --draft new=runs/smollm2/draft \\
        [--out draft_eval.json]

A draft is the embedded default's name, a model folder (``specbatch distill``'s ``OUT/draft``), or
a folder in the shipped trained-only form (``config.json`` + ``trained.safetensors``), to which
the target's embeddings and head rows are added. A draft distilled with ``--feature-layers`` is
evaluated against the target returning those layers' outputs too, as the target service would
with the same flag.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import asdict

from specbatch.commands import results
from specbatch.commands.distill.data import EVAL_PROMPTS_FROM, chat_prompt_ids
from specbatch.commands.distill.evaluate import find_eos_token_ids, speculate
from specbatch.commands.prompts import mt_bench_prompts, sharegpt_prompts
from specbatch.kernels import forms
from specbatch.models.eagle import fuse_target_features
from specbatch.models.embedded import EMBEDDED
from specbatch.models.loading import ModelSpec, default_device, load_draft, load_model, load_tokenizer, parse_dtype

SOURCES = ("sharegpt", "mt-bench")


def prompt_texts(source: str, count: int) -> list[str]:
    if source == "sharegpt":
        return sharegpt_prompts(count, start=EVAL_PROMPTS_FROM)
    texts = mt_bench_prompts(per_category=-(-count // 8))  # 8 categories, as evenly as count allows
    return texts[:count]


def markdown(rows: list[dict], k: int) -> str:
    head = ["draft", "prompts", *(f"acc {j}" for j in range(1, k + 1)), "acceptance", "tokens / target forward",
            "draft ms / token", "target ms / forward", "cost ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        e = row["evaluation"]
        cells = [row["draft"], f"{row['source']} ({e['prompts']})", *(f"{a:.2f}" for a in e["acceptance_by_position"]),
                 f"{e['acceptance']:.3f}", f"{e['tokens_per_step']:.2f}", f"{e['draft_ms_per_token']:.2f}",
                 f"{e['target_ms_per_forward']:.2f}", f"{e['cost_ratio']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", action="append", required=True, metavar="LABEL=MODEL",
                        help="a draft to evaluate (repeatable): embedded name, model folder, or trained-only folder")
    parser.add_argument("--target", default=EMBEDDED)
    parser.add_argument("--sources", default=",".join(SOURCES), help="comma-separated: " + ", ".join(SOURCES))
    parser.add_argument("--prompts", type=int, default=24, help="per source")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--device", default=None, help="default: cuda if available")
    parser.add_argument("--dtype", default="auto", help="the services' --dtype (default: theirs, 'auto')")
    parser.add_argument("--weights", default="auto", help="the target's weight form, as the services' --weights "
                        "(default: auto, what the target service runs here: q4_1 on most CPUs)")
    results.add_output_flags(parser, "draft_eval")
    args = parser.parse_args(argv)

    device = args.device or default_device()
    spec = ModelSpec(args.target)
    weights = forms.decide(args.weights, spec.name == EMBEDDED, device, args.dtype).target
    target_options = forms.engine_options(weights, device)
    dtype = parse_dtype(forms.dtype_for(weights, args.dtype), device)
    target = load_model(spec, device, dtype)
    tokenizer = load_tokenizer(spec)
    eos = find_eos_token_ids(tokenizer, target)
    drafts = dict(item.split("=", 1) if "=" in item else (item, item) for item in args.draft)
    sources = [s for s in args.sources.split(",") if s]
    prompts = {s: [chat_prompt_ids(tokenizer, t, args.max_prompt_tokens) for t in prompt_texts(s, args.prompts)]
               for s in sources}
    rows = []
    fused_targets = {}  # a draft that reads fused features (EAGLE-3) gets a target that returns them
    for label, name in drafts.items():
        draft = load_draft(name, target, device, dtype)
        layers = tuple(getattr(draft.config, "feature_layers", None) or ())
        if layers and layers not in fused_targets:
            fused_targets[layers] = fuse_target_features(copy.deepcopy(target), list(layers))
        serving = fused_targets[layers] if layers else target
        for source in sources:
            evaluation = speculate(serving, draft, prompts[source], args.k, args.new_tokens, eos, f"{label} on {source}",
                                   target_options)
            rows.append({"draft": label, "model": name, "source": source, "evaluation": asdict(evaluation)})
            print(markdown(rows[-1:], args.k).splitlines()[-1], flush=True)
    table = markdown(rows, args.k)
    print(f"\ngreedy, batch 1, k={args.k}, {args.new_tokens} new tokens, {device} {str(dtype).removeprefix('torch.')}\n")
    print(table)
    settings = {name: getattr(args, name) for name in ("target", "prompts", "k", "new_tokens", "max_prompt_tokens")}
    results.write("draft_eval", {"settings": {**settings, "device": device, "dtype": str(dtype)}, "results": rows,
                                 "markdown": table}, args.out, args.variant, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
